"""The server end to end on the real engine and a tiny random model: the official `openai` client (sync
and async, streaming and not, chat and completions), 32 concurrent streams equal to the same requests
sent alone, prefix-cache reporting, KV blocks freed on disconnect, bad inputs, `sudu serve` itself."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import httpx
import openai
import pytest

from sudu.bench.local_server import free_port
from sudu.config import EngineConfig
from sudu.server.app import build_app
from tests.helpers.live_server import LiveServer, assert_openai_error
from tests.helpers.live_server import start_patched_sudu_serve

MODEL = "tiny"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def live(tiny_model_dirs):
    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["llama"]), max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                          kv_cache_memory=8 << 20)
    engine = AsyncLLMEngine(config, max_queue_len=256)
    with LiveServer(build_app(engine, served_model_name=MODEL)) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def messages(text: str) -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def wait_all_blocks_free(engine, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    stats = engine.stats()
    while stats["num_free_blocks"] != stats["num_total_blocks"] and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = engine.stats()
    return stats


def test_chat_sync_non_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=messages("hello"), max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens  # the last token is always run
    extra = r.usage.model_extra
    assert extra["prompt_cache_hit_tokens"] + extra["prompt_cache_miss_tokens"] == r.usage.prompt_tokens
    assert set(r.model_extra["sudu"]) == {"queue_s", "prefill_s", "decode_s", "ttft_s", "cached_tokens",
                                         "cached_tokens_disk", "disk_load_s"}


def test_chat_sync_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL, messages=messages("stream me"), max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert "sudu" in finish[0].model_extra
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert "sudu" in usage_chunk.model_extra


def test_completions_sync(client):
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.usage.completion_tokens == 6
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 and len(lp.token_logprobs) == 6 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    streamed = list(client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_completions_token_prompts_and_n(client, live):
    ids = live.engine.tokenizer.encode("for i in range(10):", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both choices of a prompt agree
    assert r.usage.prompt_tokens == len(ids) + 3 and r.usage.completion_tokens == 16


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=messages("x"), max_tokens=4, logprobs=True,
                                       top_logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[-1].logprob
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages("x"), max_tokens=4, logprobs=True,
                                                 top_logprobs=3, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]  # one entry per token, as the bench counts


def test_async_client_chat_and_completions(live):
    async def run():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(model=MODEL, messages=messages("async"), max_tokens=5,
                                                    temperature=0)
        stream = await client.chat.completions.create(model=MODEL, messages=messages("async"), max_tokens=5,
                                                      temperature=0, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        comp = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
        comp_stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0,
                                                      stream=True)
        comp_streamed = "".join([c.choices[0].text async for c in comp_stream if c.choices])
        models = await client.models.list()
        await client.close()
        return chat, streamed, comp, comp_streamed, models

    chat, streamed, comp, comp_streamed, models = asyncio.run(run())
    assert streamed == chat.choices[0].message.content
    assert comp_streamed == comp.choices[0].text
    assert [m.id for m in models.data] == [MODEL]


def test_32_concurrent_streams_equal_requests_sent_alone(live, client):
    prompts = [f"request {i}: " + "abcdefgh"[: i % 8 + 1] * (i % 5 + 1) for i in range(32)]
    alone = [
        client.chat.completions.create(model=MODEL, messages=messages(p), max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].message.content
        for p in prompts
    ]

    async def one(client, prompt):
        stream = await client.chat.completions.create(model=MODEL, messages=messages(prompt), max_tokens=12,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    together = asyncio.run(run())
    assert together == alone
    assert len(set(alone)) > 1  # the prompts really differ in what they produce


def test_prefix_cache_is_reported(client):
    long_user = "The quick brown fox jumps over the lazy dog. " * 6
    first = client.chat.completions.create(model=MODEL, messages=messages(long_user), max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=messages(long_user), max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached == second.usage.model_extra["prompt_cache_hit_tokens"]
    assert second.model_extra["sudu"]["cached_tokens"] == cached
    assert first.usage.prompt_tokens == second.usage.prompt_tokens


def test_disconnect_mid_stream_frees_kv_blocks(live):
    body = {"model": MODEL, "messages": messages("keep going"), "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 5:
                break
        assert live.engine.stats()["num_free_blocks"] < live.engine.stats()["num_total_blocks"]
    stats = wait_all_blocks_free(live.engine)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_disconnect_non_stream_aborts_and_frees_kv_blocks(live, monkeypatch):
    aborted = []
    real_abort = live.engine.abort

    async def spy(request_id):
        aborted.append(request_id)
        await real_abort(request_id)

    monkeypatch.setattr(live.engine, "abort", spy)
    # 16 choices x 200 tokens: far longer than the client waits. The client hangs up once the engine runs
    # the request (a fixed client timeout could expire before a busy server even admitted it)
    body = {"model": MODEL, "messages": messages("keep going"), "max_tokens": 200, "n": 16, "ignore_eos": True}
    url = urllib.parse.urlparse(live.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while live.engine.stats()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert live.engine.stats()["num_running"] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    stats = wait_all_blocks_free(live.engine)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert aborted and aborted[0].startswith("chatcmpl-")


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/v1/chat/completions", {"messages": []}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -0.5}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 100}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4o"}, 404),
        ("/v1/completions", {"prompt": "x" * 2000, "max_tokens": 1}, 400),
        ("/v1/completions", {"prompt": [[1, 2], [10**9]]}, 400),
        ("/v1/completions", {"prompt": "x", "stop": 7}, 400),
    ],
)
def test_bad_inputs(live, path, body, status):
    err = assert_openai_error(httpx.post(live.url + path, json=body), status)
    if status == 400 and body.get("max_tokens") == 10**6:
        assert str(10**6) in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    ok = httpx.post(live.url + "/v1/chat/completions", json={"messages": messages("ok"), "max_tokens": 2})
    assert ok.status_code == 200


def test_transport_errors(live):
    r = httpx.post(live.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    assert_openai_error(httpx.get(live.url + "/v2/whatever"), 404)
    assert_openai_error(httpx.delete(live.url + "/v1/models"), 405)


def test_metrics_after_traffic(live, client):
    client.chat.completions.create(model=MODEL, messages=messages("metrics"), max_tokens=3)
    text = httpx.get(live.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["sudu:time_to_first_token_seconds_count"] >= 1
    assert values["sudu:generation_tokens_total"] >= 3
    assert values["sudu:prefix_cache_queries_total"] >= values["sudu:prefix_cache_hits_total"] > 0
    assert 0 <= values["sudu:kv_cache_usage_perc"] <= 1
    assert any(k.startswith("sudu:request_success_total{") for k in values)


def test_health_and_sse_framing(live):
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    body = {"model": MODEL, "messages": messages("frame"), "max_tokens": 3, "stream": True}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body) as r:
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])


def test_sudu_serve_cli_loads_in_background_and_stops_on_sigterm(tiny_model_dirs):
    port = free_port()
    env = dict(os.environ, SUDU_API_KEY="k", PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        [sys.executable, "-m", "sudu.cli", "serve", str(tiny_model_dirs["qwen2"]), "--port", str(port),
         "--max-model-len", "128", "--served-model-name", "cli-model", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        statuses = []
        while time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(url + "/health").status_code)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if statuses[-1] == 200:
                break
            time.sleep(0.05)
        assert statuses and statuses[-1] == 200, statuses
        assert set(statuses) <= {200, 503}
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k"}).json()
        assert models["data"][0]["id"] == "cli-model"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sudu_serve_stopped_while_loading_exits_cleanly(tiny_model_dirs):
    """SIGTERM before the model has loaded: exit 0 with a one-line message, at once (not after the load,
    and not with the abort PyTorch's C++ teardown gives when the interpreter exits under a loading thread).
    The load is held back by a sleep so the signal surely lands during it."""
    port = free_port()
    proc = start_patched_sudu_serve(tiny_model_dirs["qwen2"], port, (
        "import time\n"
        "import sudu.engine.async_engine as a\n"
        "init = a.AsyncLLMEngine.__init__\n"
        "a.AsyncLLMEngine.__init__ = lambda self, *x, **k: (time.sleep(60), init(self, *x, **k))[1]\n"
    ))
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and status is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health").status_code
            except httpx.TransportError:
                time.sleep(0.05)
        assert status == 503  # still loading
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        out = proc.stdout.read()
        assert "stopped before the model finished loading" in out
        assert "Traceback" not in out and "terminate called" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_full_queue_429_then_shutdown_fails_the_stream_with_an_error_event(tiny_model_dirs):
    from sudu.engine.async_engine import AsyncLLMEngine

    # one running sequence and no queue: a second request while the first streams is refused
    config = EngineConfig(model=str(tiny_model_dirs["llama"]), max_model_len=4096, max_num_seqs=1,
                          kv_cache_memory=8 << 20)
    engine = AsyncLLMEngine(config, max_queue_len=0)
    live = LiveServer(build_app(engine, served_model_name=MODEL, shutdown_timeout_s=0.0)).__enter__()
    try:
        body = {"messages": messages("long"), "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"role":"assistant"' in first
            refused = httpx.post(live.url + "/v1/chat/completions",
                                 json={"messages": messages("x"), "max_tokens": 2})
            assert_openai_error(refused, 429)
            assert int(refused.headers["retry-after"]) >= 1
            stopper = threading.Thread(target=live.stop)
            stopper.start()
            rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        stopper.join(60)
        assert not live.thread.is_alive()
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "request_aborted" and "shutting down" in error["message"]
    finally:
        live.stop()


def test_parameters_reach_the_engine(client):
    base = dict(model=MODEL, prompt="SELECT name", temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(max_tokens=16, **base).choices[0].text
    cut = next(i for i, ch in enumerate(text) if i >= 2 and ch.isascii() and ch.isalnum())
    stopped = client.completions.create(max_tokens=16, stop=[text[cut]], **base).choices[0]
    assert stopped.text == text[: text.index(text[cut])] and stopped.finish_reason == "stop"

    seeded = dict(model=MODEL, messages=messages("seed"), max_completion_tokens=8, temperature=1.0, seed=7)
    a = client.chat.completions.create(**seeded)
    b = client.chat.completions.create(**seeded)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 8

    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages("timing"), max_tokens=2)
    assert [p.strip().split(";")[0] for p in raw.headers["server-timing"].split(",")] == ["queue", "prefill", "decode"]


def test_stream_with_n_choices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages("n"), max_tokens=5, n=3,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)]
    assert texts[0] == texts[1] == texts[2] != ""
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]


def test_speculative_acceptance_in_timing_extension_and_metrics(tiny_model_dirs):
    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["llama"]), max_model_len=MAX_MODEL_LEN,
                          kv_cache_memory=8 << 20, speculative="ngram")
    engine = AsyncLLMEngine(config)
    with LiveServer(build_app(engine, served_model_name=MODEL)) as server:
        body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9] * 6, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        timing = r.json()["sudu"]
        assert timing["num_draft_tokens"] > 0
        assert timing["acceptance_rate"] == round(timing["num_accepted_tokens"] / timing["num_draft_tokens"], 4)
        metrics = httpx.get(server.url + "/metrics").text
        assert f"sudu:spec_decode_num_draft_tokens_total {float(timing['num_draft_tokens'])}" in metrics


def test_server_and_sudu_generate_chat_give_the_same_ids(live, tiny_model_dirs, monkeypatch, capsys):
    """One chat -> ids path: the server's request preparation and `sudu generate --chat` both go through
    Tokenizer.encode_chat, so the same conversation is the same prompt."""
    from sudu.cli import build_parser
    from sudu.engine.llm_engine import LLMEngine
    from sudu.server import protocol as P
    from sudu.server.requests import prepare_chat

    body = P.ChatCompletionRequest(messages=[{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hello there"}], max_tokens=1)
    served = prepare_chat(live.engine, body).jobs[0].prompt_ids
    seen = []
    add_request = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request",
                        lambda self, rid, prompt, *a, **k: (seen.append(list(prompt)), add_request(self, rid, prompt, *a, **k))[1])
    args = build_parser().parse_args(["generate", str(tiny_model_dirs["llama"]), "hello there", "--chat",
                                      "--system", "be brief", "--max-tokens", "1", "--max-model-len", "256",
                                      "--kv-cache-memory", "8MiB"])
    assert args.func(args) == 0
    assert seen == [served]
    assert served == live.engine.tokenizer.encode_chat([m.model_dump(exclude_none=True) for m in body.messages])


def test_huge_or_slow_requests_do_not_stall_another_stream(tiny_model_dirs, monkeypatch):
    """ITL in engine steps: while one stream decodes (one token, one chunk per step), a request with a
    slow (GIL-holding) chat template, a body of ~3 MB and one over the body limit arrive. The stream's
    chunks must keep arriving within one extra step of each other: the slow and huge work happens off
    the event loop, or is refused before it is done."""
    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["llama"]), max_model_len=MAX_MODEL_LEN, kv_cache_memory=8 << 20)
    engine = AsyncLLMEngine(config)
    step = engine.engine.step

    def paced_step():  # a step of a real model's length; time.sleep leaves the GIL to the other threads
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine.engine, "step", paced_step)
    encode_chat = engine.tokenizer.encode_chat

    def slow_encode_chat(messages, *args, **kwargs):
        if any("slow" in (m.get("content") or "") for m in messages):
            deadline = time.perf_counter() + 1.5
            while time.perf_counter() < deadline:  # pure Python, holding the GIL between switches
                pass
        return encode_chat(messages, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode_chat", slow_encode_chat)
    with LiveServer(build_app(engine, served_model_name=MODEL)) as live:
        steps_at_chunk: list[int] = []
        others: list = []

        def hostile():
            others.append(httpx.post(live.url + "/v1/chat/completions", timeout=60,
                                     json={"messages": messages("slow"), "max_tokens": 2}))
            others.append(httpx.post(live.url + "/v1/completions", timeout=60,
                                     json={"prompt": "x" * (3 << 20), "max_tokens": 2}))
            others.append(httpx.post(live.url + "/v1/completions", timeout=60,
                                     json={"prompt": "x" * (5 << 20), "max_tokens": 2}))

        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True, "temperature": 0,
                "logprobs": 0, "stream": True}  # logprobs: a chunk for every token, even one held back as text
        attacker = threading.Thread(target=hostile)
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"token_logprobs"' in line:
                    steps_at_chunk.append(engine.engine.num_steps)
                    if len(steps_at_chunk) == 5:
                        attacker.start()
        attacker.join(60)
    assert [o.status_code for o in others] == [200, 400, 413]
    assert len(steps_at_chunk) == 60
    gaps = [b - a for a, b in zip(steps_at_chunk[1:], steps_at_chunk[2:])]
    assert max(gaps) <= 2, gaps  # one step per token, plus at most one
