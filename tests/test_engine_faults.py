"""Faults injected into the engine: one that belongs to a request (its forward pass, its sampling row,
its token handling) fails that request only, and its neighbours' greedy output is unchanged; one that
cannot be pinned on a request stops the engine: every client gets an error (503 over HTTP), /health
turns 503, and `sudu serve` exits non-zero."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from sudu.config import EngineConfig
from sudu.engine.llm_engine import LLMEngine
from sudu.errors import EngineFailedError
from sudu.sampling import SamplingParams
from tests.helpers.greedy import GREEDY, prompts_of

PROMPTS = prompts_of([5, 9, 14], seed=3)
POISON = PROMPTS[1]


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return LLMEngine(EngineConfig(model=str(tiny_model_dirs["qwen2"]), kv_cache_memory=8 << 20), progress=False)


def run_all(engine, params) -> dict[str, tuple[list[int], str | None, str | None]]:
    """request id -> (generated ids, last finish reason, error) for PROMPTS run together."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    results = {f"r{i}": ([], None, None) for i in range(len(PROMPTS))}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 500
        for out in engine.step():
            ids, _, _ = results[out.request_id]
            for c in out.outputs:
                ids = ids + c.token_ids
                results[out.request_id] = (ids, c.finish_reason, out.error)
    return results


def assert_only_r1_failed(engine, clean, faulty):
    assert faulty["r1"][1] == "abort" and faulty["r1"][2]
    for rid in ("r0", "r2"):
        assert faulty[rid] == clean[rid] and faulty[rid][2] is None
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]  # the failed request's blocks came back


def poisoned(seqs) -> bool:
    return any(s.prompt_token_ids == POISON for s in seqs)


def test_forward_fault_fails_only_its_request(engine, monkeypatch):
    params = SamplingParams(max_tokens=6, **GREEDY)
    clean = run_all(engine, params)
    execute = engine.runner.execute

    def faulty(scheduled):
        if poisoned(s.seq for s in scheduled):
            raise RuntimeError("injected forward fault")
        return execute(scheduled)

    monkeypatch.setattr(engine.runner, "execute", faulty)
    assert_only_r1_failed(engine, clean, run_all(engine, params))


def test_sampling_fault_fails_only_its_request(engine, monkeypatch):
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    clean = run_all(engine, params)
    sample = engine.sampler.__class__.__call__

    def faulty(self, logits, rows):
        if any(r.prompt_token_ids == POISON for r in rows):
            raise RuntimeError("injected sampling fault")
        return sample(self, logits, rows)

    monkeypatch.setattr(engine.sampler.__class__, "__call__", faulty)
    assert_only_r1_failed(engine, clean, run_all(engine, params))


def test_token_handling_fault_fails_only_its_request(engine, monkeypatch):
    params = SamplingParams(max_tokens=6, **GREEDY)
    clean = run_all(engine, params)
    append = engine._append_token

    def faulty(seq, tok):
        if seq.prompt_token_ids == POISON and seq.num_output_tokens == 2:
            raise RuntimeError("injected detokenizer fault")
        return append(seq, tok)

    monkeypatch.setattr(engine, "_append_token", faulty)
    faulty_results = run_all(engine, params)
    assert faulty_results["r1"][0] == clean["r1"][0][:2]  # what it had before the fault was delivered
    assert_only_r1_failed(engine, clean, faulty_results)


def test_fault_of_every_request_escapes_the_step(engine, monkeypatch):
    def broken(scheduled):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(engine.runner, "execute", broken)
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(RuntimeError, match="device is gone"):
        engine.step()
    monkeypatch.undo()
    engine.abort("x")
    engine.step()
    assert not engine.has_unfinished()


def test_async_engine_that_cannot_continue_fails_every_stream(tiny_model_dirs, monkeypatch):
    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["qwen2"]), kv_cache_memory=8 << 20)
    engine = AsyncLLMEngine(config, progress=False)
    params = SamplingParams(max_tokens=200, **GREEDY)

    async def scenario():
        await engine.start()
        schedule = engine.engine.scheduler.schedule
        calls = []

        def failing_schedule():
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("injected scheduler fault")
            return schedule()

        monkeypatch.setattr(engine.engine.scheduler, "schedule", failing_schedule)

        async def consume(rid, prompt):
            got = []
            with pytest.raises(EngineFailedError):
                async for out in engine.generate(rid, engine.check_request(prompt, params)):
                    got.append(out)
            return got

        results = await asyncio.wait_for(asyncio.gather(*(consume(f"s{i}", p) for i, p in enumerate(PROMPTS))), 60)
        reason = await asyncio.wait_for(engine.wait_failed(), 5)
        assert "injected scheduler fault" in reason
        assert any(results)  # they were streaming when the engine stopped
        with pytest.raises(EngineFailedError):
            async for _ in engine.generate("late", engine.check_request(PROMPTS[0], params)):
                pass
        await engine.shutdown(1)

    asyncio.run(scenario())


def test_a_step_that_never_returns_fails_the_engine(tiny_model_dirs, monkeypatch):
    """A hung step (a kernel that never returns, a deadlock) is an engine failure after stall_timeout_s:
    the clients get EngineFailedError instead of waiting forever."""
    import threading

    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["qwen2"]), kv_cache_memory=8 << 20)
    engine = AsyncLLMEngine(config, progress=False, stall_timeout_s=1.0)
    release = threading.Event()
    step = engine.engine.step

    def hung_step():
        release.wait(60)
        return step()

    monkeypatch.setattr(engine.engine, "step", hung_step)

    async def scenario():
        await engine.start()
        params = SamplingParams(max_tokens=4, **GREEDY)
        with pytest.raises(EngineFailedError, match="no progress"):
            async for _ in engine.generate("hung", engine.check_request(PROMPTS[0], params)):
                pass
        assert "no progress" in await asyncio.wait_for(engine.wait_failed(), 5)
        release.set()
        await engine.shutdown(1)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_sudu_serve_exits_non_zero_when_the_engine_fails(tiny_model_dirs):
    from sudu.bench.local_server import free_port

    from tests.helpers.live_server import start_patched_sudu_serve

    port = free_port()
    proc = start_patched_sudu_serve(tiny_model_dirs["qwen2"], port, (
        "import sudu.engine.llm_engine as m\n"
        "def step(self):\n"
        "    raise RuntimeError('injected engine fault')\n"
        "m.LLMEngine.step = step\n"
    ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        assert proc.wait(60) != 0
        out = proc.stdout.read()
        assert "engine failed" in out and "injected engine fault" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
