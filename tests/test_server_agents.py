"""The agents' API end to end on the real engine and a tiny random model, through the official `openai`
client: tool calling (required / named / auto / none, streaming and not, a tool loop with `role: "tool"`
messages through a template without tool syntax, i.e. sudu's documented fallback), structured output
(`response_format` json_object / json_schema, vLLM's guided_* extensions, on chat and completions), and
the 400s for constraints that cannot be used, after which the server keeps serving."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.live_server import assert_openai_error, tiny_engine_server
from tests.helpers.live_server import collect_stream

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time"}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


@pytest.fixture(scope="module")
def live(tiny_model_dirs):
    with tiny_engine_server(tiny_model_dirs["qwen2"], MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_stream_and_not(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ask("weather in Paris?"), tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                  temperature=0, max_tokens=300, parallel_tool_calls=False)
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if tool_choice != "required":
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    else:
        assert json.loads(call.function.arguments) == {}
    content, calls, finish = collect_stream(client.chat.completions.create(stream=True, **kwargs))
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_parallel_calls_sampled(client):
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=ask("weather and time"), tools=[WEATHER, CLOCK],
                                           tool_choice="required", temperature=1.0, seed=seed, max_tokens=400)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls"
        assert len({c.id for c in calls}) == len(calls)
        for c in calls:
            args = json.loads(c.function.arguments)
            if c.function.name == "get_weather":
                jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_tool_loop_with_tool_messages(client):
    """call -> execute -> append the assistant turn and the tool result -> call again, as an agent does."""
    messages = ask("What should I wear in Oslo?")
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": -3, "sky": "snow"})})
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=12)
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str)
    assert final.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt


def test_auto_tool_choice_parses_or_answers(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("hi"), tools=[WEATHER], temperature=0, max_tokens=20)
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert "<tool_call>" not in (msg.content or "")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client, temperature):
    for seed in range(5):
        r = client.chat.completions.create(
            model=MODEL, messages=ask("a person"), temperature=temperature, seed=seed, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=ask("json"), temperature=temperature, max_tokens=300,
                                       response_format={"type": "json_object"}, seed=1)
    if r.choices[0].finish_reason == "stop":  # any object: a random model may not close it within the budget
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_guided_extensions_chat_and_completions(live, client):
    r = client.completions.create(model=MODEL, prompt="pick", max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]})
    assert r.choices[0].text in ("alpha", "beta", "gamma delta")
    r = client.chat.completions.create(model=MODEL, messages=ask("date"), max_tokens=20, temperature=0,
                                       extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", r.choices[0].message.content)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "stream": True,
            "guided_grammar": 'root ::= "(" [a-z] [a-z]? [a-z]? ")"\n'}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as resp:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in resp.iter_lines()
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert re.fullmatch(r"\([a-z]{1,3}\)", text)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format", "type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}}, "response_format", "missing"),
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "matches no text"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed"),
    ({"guided_grammar": "start: nowhere\n"}, "guided_grammar", "nowhere"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice",
     "missing"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": [{"type": "function"}]}, "tools", "function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "get_weather"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tool_choice", "nonsense"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice"),
])
def test_unusable_constraints_are_400_and_the_server_keeps_serving(live, body, param, words):
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": ask("x"), "max_tokens": 4, **body})
    err = assert_openai_error(r, 400)
    assert err["param"] == param or (err["param"] or "").startswith(param), err
    assert words.lower() in err["message"].lower(), err["message"]
    ok = httpx.post(live.url + "/v1/chat/completions", json={"messages": ask("ok"), "max_tokens": 2})
    assert ok.status_code == 200


def test_tool_message_answering_no_call_is_400(live):
    messages = [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_nope", "content": "1"}]
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "tools": [WEATHER]})
    err = assert_openai_error(r, 400)
    assert "call_nope" in err["message"]
