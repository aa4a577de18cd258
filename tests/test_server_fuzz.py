"""A bounded schema-driven fuzz run: schemathesis reads the live server's /openapi.json and sends
generated bodies, valid and invalid, to every route; none may get a 5xx. The engine is real (the tiny
model with a 64-token context keeps each generation short), because a 5xx would most likely come
from a sampling corner reached through odd but valid parameters."""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from sudu.config import EngineConfig  # noqa: E402
from sudu.server.app import build_app  # noqa: E402
from tests.test_server_fake_engine import LiveServer  # noqa: E402

MAX_EXAMPLES = 50  # per route and generation mode


@pytest.fixture(scope="module")
def live(tiny_model_dirs):
    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["qwen2"]), max_model_len=64, max_num_seqs=32,
                          kv_cache_memory=8 << 20)
    with LiveServer(build_app(AsyncLLMEngine(config), served_model_name="tiny")) as server:
        yield server


def _operations(url: str):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _use_served_model(case):
    # a random `model` string is a 404 every time; most cases should reach sampling instead
    if isinstance(case.body, dict) and "model" in case.body:
        case.body.pop("model")
    return case


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzz_finds_no_server_errors(live, mode):
    failures = []
    ok_labels = set()
    for operation in _operations(live.url):
        strategy = operation.as_strategy(generation_mode=mode)
        if mode is GenerationMode.POSITIVE:
            strategy = strategy.map(_use_served_model)

        @given(case=strategy)
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def run(case):
            response = case.call(timeout=60)
            if response.status_code == 200:
                ok_labels.add(operation.label)
            if response.status_code >= 500:
                failures.append((operation.label, response.status_code, case.body, response.text[:300]))

        try:
            run()
        except Unsatisfiable:  # no invalid input exists for a route without parameters (GET /health)
            assert mode is GenerationMode.NEGATIVE
    assert not failures, failures[:5]
    if mode is GenerationMode.POSITIVE:  # the valid bodies really reached generation
        assert {"POST /v1/chat/completions", "POST /v1/completions"} <= ok_labels
    assert live.thread.is_alive()
