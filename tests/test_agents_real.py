"""An agent's tool loop on the default model, with the official `openai` client against sudu's server:
the model calls a tool (its first call required, later ones its own decision), the test runs it, appends
the assistant turn and the `role: "tool"` result, and calls again. Streaming and not. Plus JSON-schema answers of the real model, greedy
and sampled, validated. Slow (a real model)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from sudu.config import EngineConfig
from sudu.server.app import build_app
from tests.helpers.live_server import collect_stream
from tests.helpers.live_server import LiveServer

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b-instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_order_status", "description": "Look up an order by its number: its status and its carrier.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "integer", "description": "The order number"}},
                   "required": ["order_id"]}}}]
ORDERS = {4821: {"status": "shipped", "carrier": "Kestrel Freight"}}


@pytest.fixture(scope="module")
def client():
    from sudu.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig(model=MODEL, kv_cache_memory=256 << 20, max_num_seqs=8), progress=False)
    with LiveServer(build_app(engine, served_model_name=MODEL)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def run_tool(name: str, arguments: str) -> str:
    assert name == "get_order_status"
    order_id = int(json.loads(arguments)["order_id"])
    return json.dumps({"order_id": order_id, **ORDERS.get(order_id, {"error": "no such order"})})


@pytest.mark.parametrize("stream", [False, True])
def test_tool_loop_round_trips(client, stream):
    """The plumbing of a tool loop on the real model and template: a well-formed call with the right
    argument, its result rendered back through Qwen's template, and every later round answered with a
    well-formed message (this 0.5B model does not reliably answer from the result: docs/structured_output.md)."""
    messages = [{"role": "user", "content": "Which carrier is delivering my order 4821? Use the tool."}]
    for round_ in range(3):
        kwargs = dict(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=200,
                      tool_choice="required" if round_ == 0 else "auto", parallel_tool_calls=False)
        if stream:
            content, calls, finish = collect_stream(client.chat.completions.create(stream=True, **kwargs))
            calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                     for c in calls]
        else:
            r = client.chat.completions.create(**kwargs)
            content, finish = r.choices[0].message.content, r.choices[0].finish_reason
            calls = [c.model_dump() for c in r.choices[0].message.tool_calls or []]
        if round_ == 0:
            assert finish == "tool_calls" and len(calls) == 1 and not content
            assert json.loads(calls[0]["function"]["arguments"]) == {"order_id": 4821}
        if not calls:
            assert finish in ("stop", "length") and isinstance(content, str) and "<tool_call>" not in content
            return
        assert finish == "tool_calls" and "<tool_call>" not in (content or "")
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": run_tool(call["function"]["name"], call["function"]["arguments"])})


def test_json_schema_answers_validate(client):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 1, "maxItems": 3},
        "climate": {"enum": ["cold", "temperate", "hot"]}},
        "required": ["city", "country", "population_millions", "landmarks", "climate"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    for temperature, seed in ((0.0, 0), (0.8, 1), (0.8, 2)):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                                           response_format=fmt, temperature=temperature, seed=seed, max_tokens=300)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
