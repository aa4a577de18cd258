"""sudu bench speaks four streaming APIs: each is sent its own body at its own path, its stream format is
parsed into the same record (answer text, timing, usage with cached tokens normalized), and reasoning is
timed apart from the answer: chat's reasoning_content deltas, Messages' thinking blocks and Responses'
reasoning items."""
import asyncio

import pytest

from sudu.bench.apis import translate
from sudu.bench.client import ClientPool, RequestRecord, auth_headers, chat_body, stream_chat
from sudu.bench.fake_server import FakeServer, chat_script
from sudu.bench.metrics import request_metrics
from tests.helpers.bench_cli import run_cli

USAGE = {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
         "prompt_tokens_details": {"cached_tokens": 64}}


def reasoning_script(body):
    pieces = [(0.010, {"reasoning_content": "Let me"}), (0.015, {"reasoning_content": " think."}),
              (0.040, "The"), (0.045, " answer"), (0.050, " is 4.")]
    return chat_script(pieces, usage=USAGE, model=body.get("model", "fake"))


def _send(srv, api, messages=None):
    async def go():
        rec = RequestRecord(0, "g", "cold")
        body = chat_body("m", messages or [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "2+2?"}], 16)
        async with ClientPool() as pool, pool.acquire() as client:
            await stream_chat(client, srv.url, body, auth_headers(None), rec, api=api)
        rec.metrics = request_metrics(rec)
        return rec

    return asyncio.run(go())


@pytest.mark.parametrize("api,path", [("chat", "/v1/chat/completions"), ("completions", "/v1/completions"),
                                      ("messages", "/v1/messages"), ("responses", "/v1/responses")])
def test_each_api_parsed_into_the_same_record(api, path):
    with FakeServer(reasoning_script) as srv:
        rec = _send(srv, api)
        sent = srv.log[-1]
    assert sent["path"] == path and rec.ok, rec.error
    assert rec.text == "The answer is 4."
    assert rec.usage["prompt_tokens"] == 100 and rec.usage["completion_tokens"] == 5
    assert rec.metrics["cached_tokens"] == 64
    body = sent["body"]
    if api == "messages":
        assert body["system"] == "Be brief." and body["messages"] == [{"role": "user", "content": "2+2?"}]
        assert body["max_tokens"] == 16 and "stream_options" not in body
    if api == "responses":
        assert body["instructions"] == "Be brief." and body["max_output_tokens"] == 16
    if api == "completions":
        assert body["prompt"] == "Be brief.\n\n2+2?"
    if api == "completions":  # text completions carry no reasoning channel: the fake sends answer text only
        assert rec.first_reasoning_s is None
        return
    assert rec.reasoning_text == "Let me think."
    # reasoning is sent first (no earlier than 10 ms after the request was read), the answer after it:
    # timed apart, and TTFT is the earlier of the two
    assert 0.010 <= rec.metrics["ttft_reasoning_s"] <= rec.metrics["ttft_answer_s"]
    assert rec.metrics["ttft_s"] == rec.metrics["ttft_reasoning_s"]
    assert rec.chunk_times_s.index(rec.metrics["ttft_answer_s"]) >= 2  # after the two reasoning chunks


def test_anthropic_usage_counts_cache_reads_into_the_prompt():
    # Anthropic's input_tokens excludes cache reads: the prompt is their sum, cached = the reads
    with FakeServer(reasoning_script) as srv:
        rec = _send(srv, "messages")
    assert rec.usage["prompt_tokens"] == 100 and rec.usage["prompt_tokens_details"]["cached_tokens"] == 64


def test_stream_errors_reported_per_api():
    def failing(body):
        return chat_script([], usage=None)  # no content at all

    with FakeServer(failing) as srv:
        for api in ("messages", "responses"):
            rec = _send(srv, api)
            assert not rec.ok and rec.error == "no content chunk received"


def test_translate_keeps_the_conversation():
    body = chat_body("m", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}], 8)
    msg = translate(body, "messages")
    assert [m["content"] for m in msg["messages"]] == ["a", "b", "c"] and "system" not in msg
    assert translate({"model": "m", "prompt": "raw", "max_tokens": 4}, "completions")["prompt"] == "raw"
    assert translate({"model": "m", "prompt": "raw", "max_tokens": 4}, "chat")["messages"] == [{"role": "user", "content": "raw"}]


def test_single_suite_over_messages_api(tmp_path):
    import json

    with FakeServer(reasoning_script) as srv:
        assert run_cli(["single", "--url", srv.url, "--api", "messages", "-n", "3", "--warmup", "0",
                        "--out", str(tmp_path), "--no-html"]) == 0
        paths = {e["path"] for e in srv.log}
    assert paths == {"/v1/messages"}
    rep = json.load(open(next(tmp_path.glob("single-*.json"))))
    g = rep["groups"][0]
    assert g["n_ok"] == 3 and "ttft_reasoning_s" in g["metrics"] and "ttft_answer_s" in g["metrics"]


def test_tool_calls_assembled_from_messages_and_responses_events():
    from sudu.bench.apis import parse_event, tool_calls

    state: dict = {}
    events = [("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {}}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "input_json_delta", "partial_json": '{"path": '}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "input_json_delta", "partial_json": '"a.py"}'}}),
              ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                                 "usage": {"output_tokens": 9}})]
    parsed = [parse_event("messages", e, d, state) for e, d in events]
    assert [k for p in parsed for k, _ in p.pieces] == ["tool", "tool", "tool"]
    assert parsed[-1].finish_reason == "tool_use" and parsed[-1].usage["completion_tokens"] == 9
    assert tool_calls(state) == [{"id": "toolu_1", "type": "function",
                                  "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]
    state = {}
    events = [{"type": "response.output_item.added", "output_index": 0,
               "item": {"type": "function_call", "call_id": "call_9", "name": "grep"}},
              {"type": "response.function_call_arguments.delta", "output_index": 0, "delta": '{"q": 1}'},
              {"type": "response.completed", "response": {"status": "completed", "usage": {
                  "input_tokens": 30, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 5,
                  "output_tokens_details": {"reasoning_tokens": 2}}}}]
    parsed = [parse_event("responses", None, d, state) for d in events]
    assert tool_calls(state)[0]["function"] == {"name": "grep", "arguments": '{"q": 1}'}
    assert parsed[-1].done and parsed[-1].usage == {"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35,
                                                    "prompt_tokens_details": {"cached_tokens": 16},
                                                    "completion_tokens_details": {"reasoning_tokens": 2}}
    failed = parse_event("responses", None, {"type": "response.failed", "response": {"error": {"message": "boom"}}}, {})
    assert failed.error == "response failed: boom"
