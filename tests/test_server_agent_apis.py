"""Anthropic's Messages API and OpenAI's Responses API end to end, driven by the official clients (`anthropic`,
`openai`'s `client.responses`) against the real engine and a tiny random model: a multi-turn tool loop,
streaming and not (every event type of each API's stream checked, the streamed result equal to the
single body), continued conversations served from the context cache, and malformed requests answered
4xx in each API's own error shape while the server keeps serving."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from sudu.server.app import build_app
from tests.helpers.live_server import LiveServer, assert_openai_error, tiny_engine_server

MODEL = "tiny"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                     "parameters": WEATHER_SCHEMA}
MESSAGES_EVENTS = {"message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                   "message_delta", "message_stop"}


@pytest.fixture(scope="module")
def live(tiny_model_dirs):
    with tiny_engine_server(tiny_model_dirs["qwen2"], MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def raw_sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, decoded data) of every SSE event."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
    return events


def without_ids(value):
    """A response body with its generated ids blanked (they differ per call by design)."""
    if isinstance(value, dict):
        return {k: ("<id>" if k in ("id", "call_id", "item_id") else without_ids(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


# ---------------------------------------------------------------- Messages


def test_messages_tool_loop_stream_equals_single(claude, live):
    kwargs = dict(model=MODEL, max_tokens=200, extra_body={"temperature": 0}, system="You check the weather.",
                  tools=[ANTHROPIC_WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    messages = [{"role": "user", "content": "What should I wear in Oslo?"}]
    first = claude.messages.create(messages=messages, **kwargs)
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER_SCHEMA)
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert first.usage.output_tokens > 0 and first.usage.cache_creation_input_tokens == 0

    with claude.messages.stream(messages=messages, **kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_message()
    assert without_ids(streamed.model_dump(exclude={"usage"})) == without_ids(first.model_dump(exclude={"usage"}))
    assert streamed.usage.output_tokens == first.usage.output_tokens
    # the same prompt again: now served from the cache (split differently, same total)
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == first_prompt
    assert streamed.usage.cache_read_input_tokens > 0

    # every event type, in Anthropic's order, from the wire
    with httpx.stream("POST", live.url + "/v1/messages", json={**_plain(kwargs), "messages": messages,
                                                               "stream": True}) as r:
        events = raw_sse(r)
    names = [n for n, _ in events]
    assert set(names) == MESSAGES_EVENTS
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert all(n == data["type"] for n, data in events)
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert set(deltas) == {"input_json_delta"}

    # the tool result goes back; the next turn's prompt starts with the whole first turn, from the cache
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                               "content": [{"type": "text", "text": "-3 C, snow"}]}]}]
    kwargs["tool_choice"] = {"type": "none"}
    second = claude.messages.create(messages=messages, **{**kwargs, "max_tokens": 12})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]
    assert second.usage.cache_read_input_tokens >= first_prompt
    with claude.messages.stream(messages=messages, **{**kwargs, "max_tokens": 12}) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == second.content[0].text
    assert without_ids(streamed.model_dump(exclude={"usage"})) == without_ids(second.model_dump(exclude={"usage"}))
    assert streamed.usage.output_tokens == second.usage.output_tokens


def _plain(kwargs: dict) -> dict:
    """SDK keyword arguments as the JSON body they send."""
    body = {k: v for k, v in kwargs.items() if k != "extra_body"}
    return {**body, **kwargs.get("extra_body", {})}


def test_messages_stop_sequence_and_count_tokens(claude):
    messages = [{"role": "user", "content": "count"}]
    whole = claude.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=messages)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"
    text = whole.content[0].text
    if len(text) > 4:  # the greedy answer, cut by a stop sequence taken from its own middle
        stop = text[2:4]
        cut = claude.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=messages,
                                     stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        expected = text[:text.index(stop)]
        assert [b.text for b in cut.content] == ([expected] if expected else [])  # no text, no text block
    counted = claude.messages.count_tokens(model=MODEL, messages=messages)
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, "toolu_nope"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "parameters"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "text only"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool"}}, "name"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": []}, "messages"),
])
def test_messages_malformed_requests_are_anthropic_400s(live, body, where):
    r = httpx.post(live.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 400, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and where in error["error"]["message"]
    ok = httpx.post(live.url + "/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200


def test_messages_unknown_model_and_route_are_anthropic_404s(live, claude):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------- Responses


def _function_calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def test_responses_tool_loop_stream_equals_single(oai, live):
    kwargs = dict(model=MODEL, max_output_tokens=200, temperature=0, instructions="You check the weather.",
                  tools=[RESPONSES_WEATHER], tool_choice="required", parallel_tool_calls=False)
    first = oai.responses.create(input="What should I wear in Oslo?", **kwargs)
    assert first.object == "response" and first.status == "completed" and first.model == MODEL
    calls = _function_calls(first)
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens

    events = list(oai.responses.create(input="What should I wear in Oslo?", stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert {"response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"} <= set(types)
    streamed = events[-1].response
    assert without_ids(streamed.model_dump(exclude={"created_at", "usage"})) == without_ids(
        first.model_dump(exclude={"created_at", "usage"}))
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == \
        (first.usage.input_tokens, first.usage.output_tokens)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == _function_calls(streamed)[0].arguments

    # continue with only the new item: the stored conversation makes the prompt, served from the cache
    follow = dict(kwargs, tool_choice="none", max_output_tokens=12)
    second = oai.responses.create(previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "-3 C, snow"}], **follow)
    assert second.previous_response_id == first.id and not _function_calls(second)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert isinstance(second.output_text, str)
    events = list(oai.responses.create(previous_response_id=first.id, stream=True, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "-3 C, snow"}], **follow))
    types = {e.type for e in events}
    assert {"response.content_part.added", "response.output_text.delta", "response.output_text.done",
            "response.content_part.done"} <= types
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == second.output_text
    assert events[-1].response.output_text == second.output_text

    # the same conversation sent whole (no store) gives the same answer
    whole = oai.responses.create(store=False, input=[
        {"role": "user", "content": "What should I wear in Oslo?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "-3 C, snow"}], **follow)
    assert whole.output_text == second.output_text
    assert oai.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(whole.id)  # store: false keeps nothing


def test_responses_json_schema_text_format(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = oai.responses.create(model=MODEL, input="json please", temperature=0, max_output_tokens=40,
                             text={"format": {"type": "json_schema", "name": "flag", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("body, status, param", [
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
     "messages.0.content.0.image_url"),  # a text-only model: the image part of the chat request it becomes
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, 400, "tools"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, 400, "messages"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "background": True}, 400, "background"),
])
def test_responses_malformed_requests_are_openai_errors(live, body, status, param):
    error = assert_openai_error(httpx.post(live.url + "/v1/responses", json=body), status)
    assert error["param"] == param
    ok = httpx.post(live.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2})
    assert ok.status_code == 200


# ---------------------------------------------------------------- the edges, on the scripted fake engine


@pytest.fixture(scope="module")
def keyed():
    from tests.helpers.fake_engine import FakeEngine

    engine = FakeEngine()
    with LiveServer(build_app(engine, served_model_name="m", api_key="sk-test")) as server:
        server.engine = engine
        yield server


def test_x_api_key_and_anthropic_version(keyed):
    ok = anthropic.Anthropic(base_url=keyed.url, api_key="sk-test", max_retries=0)  # sends x-api-key
    answer = ok.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert answer.usage.output_tokens == 3
    bearer = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-test", max_retries=0)
    assert bearer.responses.create(model="m", input="hi", max_output_tokens=3).usage.output_tokens == 3
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": info.value.body["error"]["message"]}}
    r = httpx.post(keyed.url + "/v1/responses", json={"input": "hi"}, headers={"x-api-key": "wrong"})
    assert assert_openai_error(r, 401)["type"] == "authentication_error"


def test_full_queue_is_anthropic_overloaded_error_with_retry_after(keyed):
    keyed.engine.full = True
    try:
        r = httpx.post(keyed.url + "/v1/messages", headers={"x-api-key": "sk-test"},
                       json={"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
        r = httpx.post(keyed.url + "/v1/responses", headers={"x-api-key": "sk-test"}, json={"input": "hi"})
        assert assert_openai_error(r, 429)["type"] == "rate_limit_error" and "retry-after" in r.headers
    finally:
        keyed.engine.full = False
    r = httpx.post(keyed.url + "/v1/messages", headers={"x-api-key": "sk-test"},
                   json={"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200


def test_engine_failure_mid_stream_ends_with_anthropic_error_event(keyed):
    """A Messages stream cut by a failing engine ends with Anthropic's `error` event (the last test here:
    the engine stays failed)."""
    keyed.engine.step_s = 0.01
    names, last = [], None
    with httpx.stream("POST", keyed.url + "/v1/messages", headers={"x-api-key": "sk-test"}, timeout=30,
                      json={"max_tokens": 400, "stream": True, "messages": [{"role": "user", "content": "x"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[len("event: "):])
                if names.count("content_block_delta") == 3:
                    keyed.engine.fail("injected")
            elif line.startswith("data: "):
                last = json.loads(line[len("data: "):])
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "error"
    assert "message_stop" not in names
    assert last == {"type": "error", "error": {"type": "overloaded_error", "message": last["error"]["message"]}}
