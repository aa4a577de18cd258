"""The server's hard edges against a scripted fake of the AsyncLLMEngine contract: states the real engine
reaches only under load or by accident (full queue, a handler crashing, a model still loading, a
shutdown with requests in flight) are set up here exactly. Also home of `LiveServer`, the uvicorn-in-a-
thread helper the other server tests use."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from sudu.server.app import build_app
from sudu.server.limits import ServerLimits
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.live_server import LiveServer, assert_openai_error, sse_events




# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    with LiveServer(build_app(engine, served_model_name="fake")) as live:
        live.engine = engine
        yield live


def chat(url, content="hi", **extra):
    body = {"model": "fake", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


# ---------------------------------------------------------------- tests


def test_chat_round_trip_has_usage_timing_and_server_timing(fake):
    r = chat(fake.url)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "user"}
    usage = body["usage"]
    prompt_len = len("user: hi\nassistant: ")
    assert usage["prompt_tokens"] == prompt_len and usage["completion_tokens"] == 4
    assert usage["total_tokens"] == prompt_len + 4
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["prompt_cache_hit_tokens"] == 0 and usage["prompt_cache_miss_tokens"] == prompt_len
    assert set(body["sudu"]) == {"queue_s", "prefill_s", "decode_s", "ttft_s", "cached_tokens", "cached_tokens_disk",
                                 "disk_load_s"}
    parts = [p.strip() for p in r.headers["server-timing"].split(",")]
    assert [p.split(";")[0] for p in parts] == ["queue", "prefill", "decode"]
    assert all(p.split(";")[1].startswith("dur=") for p in parts)


def test_stream_shape(fake):
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "n": 2, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", fake.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake" and c["id"] == chunks[0]["id"]
               and isinstance(c["created"], int) for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(ch["delta"].get("content", "") for ch in mine) == "use"
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}
    finish_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert all("sudu" in c for c in finish_chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    assert "sudu" in usage_chunk


def test_completions_multi_prompt_and_logprobs(fake):
    body = {"model": "fake", "prompt": [[97, 98, 99], [100, 101]], "max_tokens": 2, "logprobs": 1, "echo": True}
    r = httpx.post(fake.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == ["abcab", "dede"]
    assert choices[0]["logprobs"]["tokens"] == ["a", "b"]
    assert choices[0]["logprobs"]["text_offset"] == [3, 4]
    assert r.json()["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400,
         "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
         "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400,
         "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ("/v1/completions", {"prompt": ""}, 400, None),
        ("/v1/completions", {"prompt": [1, 999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x" * 600}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
    ],
)
def test_bad_inputs_get_openai_errors(fake, path, body, status, param):
    err = assert_openai_error(httpx.post(fake.url + path, json=body), status)
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)
    assert chat(fake.url).status_code == 200


def test_too_long_names_the_numbers(fake):
    err = assert_openai_error(chat(fake.url, max_tokens=100000), 400)
    assert "100000" in err["message"] and "512" in err["message"]
    assert err["code"] == "context_length_exceeded"


def test_malformed_json_route_and_method(fake):
    r = httpx.post(fake.url + "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert assert_openai_error(r, 400)["code"] == "invalid_json"
    assert_openai_error(httpx.get(fake.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(fake.url + "/v1/chat/completions"), 405)
    assert chat(fake.url).status_code == 200


def test_unexpected_exception_is_500_and_server_keeps_serving(fake):
    fake.engine.fail_check_for = "user: boom\nassistant: "
    try:
        err = assert_openai_error(chat(fake.url, "boom"), 500)
        assert err["type"] == "server_error"
    finally:
        fake.engine.fail_check_for = None
    assert chat(fake.url).status_code == 200


def test_full_queue_is_429_with_retry_after(fake):
    fake.engine.full = True
    try:
        r = chat(fake.url)
        assert_openai_error(r, 429)
        assert int(r.headers["retry-after"]) >= 1
    finally:
        fake.engine.full = False
    assert chat(fake.url).status_code == 200
    assert 'sudu:request_errors_total{code="queue_full",status="429"}' in httpx.get(fake.url + "/metrics").text


def test_stream_disconnect_aborts(fake):
    body = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", fake.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 10
    while fake.engine.blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.engine.blocks == {} and fake.engine.aborted


def test_non_stream_disconnect_aborts(fake):
    before = set(fake.engine.aborted)
    body = {"messages": [{"role": "user", "content": "y" * 40}], "max_tokens": 400}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake.url + "/v1/chat/completions", json=body, timeout=0.2)
    deadline = time.monotonic() + 10
    while (fake.engine.blocks or fake.engine.aborted == before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.engine.blocks == {} and fake.engine.aborted != before


def test_metrics_exposition(fake):
    chat(fake.url)
    text = httpx.get(fake.url + "/metrics").text
    for name in ("sudu:time_to_first_token_seconds_bucket", "sudu:inter_token_latency_seconds_bucket",
                 "sudu:e2e_request_latency_seconds_count", "sudu:request_queue_time_seconds_sum",
                 "sudu:prompt_tokens_total", "sudu:generation_tokens_total", "sudu:prefix_cache_queries_total 10.0",
                 "sudu:prefix_cache_hits_total 4.0", 'sudu:request_success_total{finish_reason="length"}',
                 "sudu:num_requests_running", "sudu:num_requests_waiting", "sudu:kv_cache_usage_perc"):
        assert name in text, name


def test_models_and_openapi(fake):
    models = httpx.get(fake.url + "/v1/models").json()
    assert models["data"][0]["id"] == "fake" and models["data"][0]["max_model_len"] == 512
    schema = httpx.get(fake.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])


def test_api_key():
    with LiveServer(build_app(FakeEngine(), api_key="sekrit")) as live:
        assert_openai_error(chat(live.url), 401)
        r = httpx.post(live.url + "/v1/chat/completions", headers={"Authorization": "Bearer wrong"},
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert assert_openai_error(r, 401)["type"] == "authentication_error"
        r = httpx.post(live.url + "/v1/chat/completions", headers={"Authorization": "Bearer sekrit"},
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert r.status_code == 200
        assert httpx.get(live.url + "/health").status_code == 200
        assert httpx.get(live.url + "/metrics").status_code == 200


def test_health_is_503_until_loaded():
    release = threading.Event()

    def load():
        release.wait(30)
        return FakeEngine()

    with LiveServer(build_app(load_engine=load)) as live:
        assert httpx.get(live.url + "/health").status_code == 503
        assert_openai_error(chat(live.url), 503)
        release.set()
        live.wait_healthy(30)
        assert chat(live.url, model="fake-model").status_code == 200


def test_graceful_shutdown_ends_streams_with_an_error_event():
    engine = FakeEngine(step_s=0.01)
    app = build_app(engine, shutdown_timeout_s=0.2)
    live = LiveServer(app).__enter__()
    events: list = []

    def consume():
        body = {"messages": [{"role": "user", "content": "z"}], "max_tokens": 10000 // 30, "stream": True}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as r:
            events.extend(sse_events(r))

    reader = threading.Thread(target=consume)
    reader.start()
    while not engine.blocks:
        time.sleep(0.01)
    live.stop()
    reader.join(30)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_aborted"
    assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events[:-2])


def test_graceful_shutdown_fails_non_stream_requests_with_503():
    engine = FakeEngine(step_s=0.01)
    live = LiveServer(build_app(engine, shutdown_timeout_s=0.2)).__enter__()
    responses: list = []
    body = {"messages": [{"role": "user", "content": "z"}], "max_tokens": 300}
    reader = threading.Thread(target=lambda: responses.append(
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)))
    reader.start()
    while not engine.blocks:
        time.sleep(0.01)
    live.stop()
    reader.join(30)
    assert assert_openai_error(responses[0], 503)["code"] == "request_aborted"


def test_continuous_usage_stats(fake):
    body = {"prompt": "abcd", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", fake.url + "/v1/completions", json=body) as r:
        events = sse_events(r)
    content = [e for e in events[:-1] if e["choices"] and e["choices"][0]["text"]]
    assert [e["usage"]["completion_tokens"] for e in content] == [1, 2, 3]
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-2]["choices"] == []


# ---------------------------------------------------------------- hostile traffic and engine failure


def test_oversized_body_is_413_before_it_is_read():
    engine = FakeEngine()
    with LiveServer(build_app(engine, served_model_name="fake", limits=ServerLimits(max_request_bytes=4096))) as live:
        big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2}
        err = assert_openai_error(httpx.post(live.url + "/v1/chat/completions", json=big), 413)
        assert err["code"] == "request_too_large" and "4096" in err["message"]

        def chunks():  # no Content-Length: the limit is enforced while the body streams in
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}]}'

        r = httpx.post(live.url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert assert_openai_error(r, 413)["code"] == "request_too_large"
        assert engine.tokenizer.encoded_chars == 0
        assert chat(live.url).status_code == 200
        metrics = httpx.get(live.url + "/metrics").text
        assert 'sudu:request_errors_total{code="request_too_large",status="413"} 2.0' in metrics


def test_prompt_longer_than_the_context_can_cover_is_refused_before_tokenizing(fake):
    before = fake.engine.tokenizer.encoded_chars
    err = assert_openai_error(chat(fake.url, "z" * 600), 400)  # 600 chars > 512 tokens x 1 char per token
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": ["ok", "z" * 600], "max_tokens": 2})
    assert assert_openai_error(r, 400)["code"] == "context_length_exceeded"
    assert fake.engine.tokenizer.encoded_chars - before == len("ok")  # the long prompt was never tokenized


@pytest.mark.parametrize("field,value", [
    ("stop_token_ids", list(range(65))),
    ("stop", ["s"] * 17),
    ("stop", "s" * 1025),
    ("messages", [{"role": "user", "content": "x"}] * 4097),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": "x"}] * 257}]),
])
def test_list_fields_are_bounded(fake, field, value):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, field: value}
    err = assert_openai_error(httpx.post(fake.url + "/v1/chat/completions", json=body), 400)
    assert err["param"].startswith(field)


def test_completion_prompt_count_is_checked_before_tokenizing(fake):
    before = fake.engine.tokenizer.encoded_chars
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": ["abc"] * 100, "n": 3, "max_tokens": 2})
    assert "choices" in assert_openai_error(r, 400)["message"]
    assert fake.engine.tokenizer.encoded_chars == before


def test_each_request_is_checked_once(fake):
    before = fake.engine.num_checks
    assert chat(fake.url).status_code == 200
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert r.status_code == 200
    assert fake.engine.num_checks - before == 1 + 3  # once per engine request, never again downstream


def test_full_prepare_pool_is_429_and_a_slow_tokenization_stalls_no_one():
    engine = FakeEngine()
    engine.tokenizer.hold = threading.Event()
    with LiveServer(build_app(engine, served_model_name="fake",
                              limits=ServerLimits(prepare_workers=1, prepare_queue=0))) as live:
        slow: list = []
        stuck = threading.Thread(target=lambda: slow.append(chat(live.url, "hold")))
        stuck.start()
        deadline = time.monotonic() + 10
        while live.app.state.sudu.pool.num_admitted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        # the only worker is busy: the next request is refused at once, and the event loop still serves
        r = chat(live.url)
        assert assert_openai_error(r, 429)["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
        assert httpx.get(live.url + "/health").status_code == 200
        engine.tokenizer.hold.set()
        stuck.join(30)
        assert slow[0].status_code == 200
        assert chat(live.url).status_code == 200


def test_engine_failure_fails_every_client_with_503_and_turns_health_503():
    engine = FakeEngine(step_s=0.01)
    reasons: list = []
    with LiveServer(build_app(engine, served_model_name="fake", on_engine_failure=reasons.append)) as live:
        events: list = []

        def consume():
            body = {"messages": [{"role": "user", "content": "z"}], "max_tokens": 400, "stream": True}
            with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as r:
                events.extend(sse_events(r))

        waiting: list = []
        reader = threading.Thread(target=consume)
        non_stream = threading.Thread(target=lambda: waiting.append(chat(live.url, max_tokens=400)))
        reader.start()
        non_stream.start()
        while len(engine.blocks) < 2:
            time.sleep(0.01)
        engine.fail("injected")
        reader.join(30)
        non_stream.join(30)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_failed"
        assert assert_openai_error(waiting[0], 503)["code"] == "engine_failed"
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "failed", "error": "injected"}
        assert assert_openai_error(chat(live.url), 503)["code"] == "engine_failed"
        assert reasons == ["injected"]
