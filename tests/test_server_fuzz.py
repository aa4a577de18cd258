"""A bounded schema-driven fuzz run: schemathesis reads the live server's /openapi.json and sends
generated bodies to every route, valid ones (positive) and invalid ones (the negative-data phase), and
then chains calls through the schema's OpenAPI links (the stateful phase: the served model's id into
a completion, an answer into the next turn, a response id into a continued Responses conversation).
The agent APIs (/v1/messages, /v1/responses) are fuzzed like the chat routes, and the three chat routes again
against a vision-language model, with image parts in the generated bodies. None may get a 5xx, and the server
keeps serving. The engine is real (the tiny model with a 64-token context keeps each generation short),
because a 5xx would most likely come from a sampling corner reached through odd but valid parameters."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.generation.stateful import run_state_machine_as_test

from sudu.config import EngineConfig
from sudu.server.app import build_app
from tests.helpers.live_server import LiveServer

MAX_EXAMPLES = 50  # per route and generation mode
COMPLETION_ROUTES = {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "POST /v1/responses"}


@pytest.fixture(scope="module")
def live(tiny_model_dirs):
    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["qwen2"]), max_model_len=64, max_num_seqs=32,
                          kv_cache_memory=8 << 20)
    with LiveServer(build_app(AsyncLLMEngine(config), served_model_name="tiny")) as server:
        yield server


def _schema(url: str):
    return schemathesis.openapi.from_url(url + "/openapi.json")


def _use_served_model(case):
    # a random `model` string is a 404 every time; most cases should reach sampling instead
    if isinstance(case.body, dict) and "model" in case.body:
        case.body.pop("model")
    return case


def _fuzz(operation, mode, observe) -> None:
    """MAX_EXAMPLES generated cases of one operation (valid ones, with the served model, or invalid ones, by
    mode) sent to the server; observe(case, response) sees each."""
    strategy = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:
        strategy = strategy.map(_use_served_model)

    @given(case=strategy)
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case):
        observe(case, case.call(timeout=60))

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzz_finds_no_server_errors(live, mode):
    failures = []
    ok_labels, tried_labels = set(), set()
    for result in _schema(live.url).get_all_operations():
        operation = result.ok()

        def observe(case, response, label=operation.label):
            tried_labels.add(label)
            if response.status_code == 200:
                ok_labels.add(label)
            if response.status_code >= 500:
                failures.append((label, response.status_code, case.body, response.text[:300]))

        try:
            _fuzz(operation, mode, observe)
        except Unsatisfiable:  # no invalid input exists for a route without parameters (GET /health)
            assert mode is GenerationMode.NEGATIVE and operation.label not in COMPLETION_ROUTES
    assert not failures, failures[:5]
    assert COMPLETION_ROUTES <= tried_labels
    if mode is GenerationMode.POSITIVE:  # the valid bodies really reached generation
        assert COMPLETION_ROUTES <= ok_labels
    assert live.thread.is_alive()


def test_stateful_chains_find_no_server_errors(live):
    failures, transitions = [], []

    class Chains(_schema(live.url).as_state_machine()):
        def get_call_kwargs(self, case):
            return {"timeout": 60}

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            # the property under test is "no 5xx, ever"; response-schema conformance of 4xx bodies
            # and of SSE streams is covered by the other server tests
            if response.status_code >= 500:
                failures.append((case.operation.label, response.status_code, case.body, response.text[:300]))

        def step(self, input):
            if input.transition is not None:
                transitions.append(input.case.operation.label)
            return super().step(input)

    run_state_machine_as_test(Chains, settings=settings(
        max_examples=15, stateful_step_count=4, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    assert not failures, failures[:5]
    assert COMPLETION_ROUTES & set(transitions)  # calls really were chained through the links
    assert live.thread.is_alive()


VISION_ROUTES = COMPLETION_ROUTES - {"POST /v1/completions"}  # the routes whose messages take images


@pytest.fixture(scope="module")
def live_vlm(tmp_path_factory):
    from sudu.engine.async_engine import AsyncLLMEngine
    from tests.helpers.tiny_vlm import save_tiny_vlm

    model_dir, _ = save_tiny_vlm(tmp_path_factory.mktemp("fuzz_vlm") / "model")
    config = EngineConfig(model=str(model_dir), max_model_len=256, max_num_seqs=8, kv_cache_memory=8 << 20)
    with LiveServer(build_app(AsyncLLMEngine(config), served_model_name="tiny-vl")) as server:
        yield server


def _has_image_part(body) -> bool:
    """Whether a generated body carries an image part anywhere (chat, Messages or Responses shape)."""
    if isinstance(body, dict):
        if body.get("type") in ("image_url", "image", "input_image"):
            return True
        return any(_has_image_part(v) for v in body.values())
    if isinstance(body, list):
        return any(_has_image_part(v) for v in body)
    return False


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzzed_image_parts_find_no_server_errors(live_vlm, mode):
    """A vision-language model's chat routes, fuzzed: generated bodies carry image parts (random data: URLs,
    other schemes, odd base64 and media types); each gets an answer or a 4xx, never a 5xx, and the server
    keeps serving. The run must have sent image parts, or it proves nothing about them."""
    failures, with_images = [], 0
    for result in _schema(live_vlm.url).get_all_operations():
        operation = result.ok()
        if operation.label not in VISION_ROUTES:
            continue

        def observe(case, response, label=operation.label):
            nonlocal with_images
            with_images += _has_image_part(case.body)
            if response.status_code >= 500:
                failures.append((label, response.status_code, case.body, response.text[:300]))

        _fuzz(operation, mode, observe)
    assert not failures, failures[:5]
    assert with_images > 0
    assert live_vlm.thread.is_alive()
