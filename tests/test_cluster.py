"""sudu serve --replicas (sudu/cluster/): the routing policy on its own, the router's block ids against
the engine's, and one `sudu serve --replicas 2` on a local Ray instance (1 CPU per replica): outputs
equal to a single engine, conversations kept where their prefix is cached, the route reported, and a
replica killed mid-stream."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sudu.bench.local_server import free_port
from sudu.cluster.serve import ROUTING_STATS_PERIOD_S
from sudu.cluster.cache_view import ReplicaCache, choose, expand, prompt_block_ids, short_id, summarize
from sudu.config import EngineConfig
from sudu.server.responses import _LOGPROB_FLOOR as LOGPROB_FLOOR
from sudu.sampling import SamplingParams

MAX_MODEL_LEN = 1024
BLOCK = 16


# ---- the policy, no Ray ----------------------------------------------------------------------------

def _cache(ids: list[int], version: int = 1) -> ReplicaCache:
    c = ReplicaCache()
    c.update(version, np_summary(ids))
    return c


def np_summary(ids: list[int]) -> bytes:
    import numpy as np

    return np.array(sorted(set(ids)), dtype="<u8").tobytes()


def test_summary_round_trip():
    ids = [bytes([i]) * 16 for i in range(10)]
    assert expand(summarize(ids)) == {short_id(h) for h in ids}


def test_longest_prefix_wins_and_only_a_leading_run_counts():
    prompt = [1, 2, 3, 4]
    caches = {"a": _cache([1, 2]), "b": _cache([1, 2, 3]), "c": _cache([2, 3, 4])}
    choice = choose(prompt, caches, {"a": 0, "b": 1, "c": 0}, imbalance_threshold=4)
    assert choice.order[0] == "b" and choice.reason == "prefix"
    assert choice.predicted_blocks == {"a": 2, "b": 3, "c": 0}


def test_load_guard_sends_to_the_least_loaded():
    caches = {"a": _cache([1, 2, 3]), "b": _cache([])}
    assert choose([1, 2, 3], caches, {"a": 5, "b": 1}, imbalance_threshold=4).order[0] == "a"
    choice = choose([1, 2, 3], caches, {"a": 6, "b": 1}, imbalance_threshold=4)
    assert choice.order[0] == "b" and choice.reason == "load_guard"


def test_no_hit_goes_to_the_least_loaded():
    choice = choose([7, 8], {"a": _cache([1]), "b": _cache([2])}, {"a": 3, "b": 2}, imbalance_threshold=4)
    assert choice.order == ["b", "a"] and choice.reason == "least_loaded"


def test_eviction_reaches_the_view_and_pending_blocks_expire():
    c = _cache([1, 2, 3])
    c.add_pending([1, 2, 3, 4, 5], now=0.0)
    assert c.hit_blocks([1, 2, 3, 4, 5]) == 5  # 4 and 5 were sent there: about to be cached
    c.update(2, np_summary([1, 2, 4]))  # the replica evicted 3 and cached 4
    assert c.hit_blocks([1, 2, 3]) == 2
    assert c.pending == {5: 0.0}
    c.expire(now=10.0, ttl_s=30.0)
    assert c.pending == {5: 0.0}
    c.expire(now=100.0, ttl_s=30.0)
    assert c.pending == {}


def test_router_block_ids_are_the_engines(tiny_model_dirs):
    from sudu.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dirs["llama"]), max_model_len=256, kv_cache_memory=4 << 20))
    prompt = list(range(3, 3 + 5 * BLOCK + 7))
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    bm = engine.block_manager
    cached = {short_id(h) for h in bm.cached_block_ids()}
    predicted = prompt_block_ids(bm.namespace, prompt, bm.block_size)
    assert len(predicted) == 5 and set(predicted) <= cached
    other = prompt_block_ids(bytes(16), prompt, bm.block_size)  # another namespace: other ids
    assert not set(other) & cached


def test_plain_sudu_serve_does_not_import_ray():
    code = ("import sys; from sudu.cli import build_parser; from sudu.server.app import build_app; "
            "args = build_parser().parse_args(['serve', '--port', '1']); assert args.replicas is None; "
            "build_app(load_engine=lambda: None); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_zero_replicas_is_refused():
    from sudu.cli import main

    assert main(["serve", "--replicas", "0", "--port", "1"]) == 2


# ---- sudu serve --replicas 2 on a local Ray instance -------------------------------------------------

def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _replica_pids(server_pid: int) -> list[int]:
    pids = []
    for pid in _descendants(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ServeReplica:sudu:engine" in cmdline:
            pids.append(pid)
    return pids


def _wait_health(url: str, want: set[str], timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        try:
            body = httpx.get(url + "/health", timeout=10).json()
            if body.get("status") in want:
                return body
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"/health never reached {want} within {timeout_s} s: {body}")


def _serve(tiny_model_dirs, log, *flags):
    """`sudu serve` of the tiny llama on a local Ray instance with these flags, until healthy: (process, url)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sudu.cli", "serve", str(tiny_model_dirs["llama"]), "--port", str(port), *flags,
           "--replica-cpus", "1", "--disk-cache-size", "0", "--max-model-len", str(MAX_MODEL_LEN),
           # int8: the tiny model's float weights would run PyTorch GEMMs, whose sums depend on the row count
           # (docs/exactness.md), and the replicas' answers are compared bit for bit with one engine's
           "--quantization", "int8",
           "--kv-cache-memory", "16MiB", "--served-model-name", "tiny", "--shutdown-timeout", "5"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            _wait_health(url, {"ok"}, timeout_s=420)  # a loaded 2-core machine starts Ray slowly
        except AssertionError:
            raise AssertionError(log.read_text()[-4000:]) from None
        yield proc, url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, tmp_path_factory):
    yield from _serve(tiny_model_dirs, tmp_path_factory.mktemp("cluster") / "serve.log", "--replicas", "2")


def _tokens(start: int, n: int) -> list[int]:
    return [10 + (start + i) % 370 for i in range(n)]  # inside the tiny model's vocabulary


def _complete(url: str, prompt, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _one_engine(llm, prompts) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy 8 tokens and their logprobs (as the server writes them: floored, never -inf) from
    one engine, all prompts in one batch."""
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    return [(o.outputs[0].token_ids, [max(lp.logprob, LOGPROB_FLOOR) for lp in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)]


@pytest.mark.slow
def test_outputs_through_the_router_equal_one_engine(cluster, tiny_model_dirs):
    from sudu.engine.llm import LLM

    _, url = cluster
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(20)]
    llm = LLM(str(tiny_model_dirs["llama"]), max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20,
              quantization="int8")
    expected = _one_engine(llm, prompts)
    replicas = set()
    for prompt, (want, want_logprobs) in zip(prompts, expected):
        r = _complete(url, prompt, logprobs=0)
        assert r.status_code == 200, r.text
        body = r.json()
        got = [llm.tokenizer.token_to_id(t) for t in body["choices"][0]["logprobs"]["tokens"]]
        assert body["choices"][0]["text"] == llm.tokenizer.decode(want), (got, want)
        # bit for bit: the replica computed each token's logprob as one engine computes it in a batch of 20
        assert body["choices"][0]["logprobs"]["token_logprobs"] == want_logprobs
        replicas.add(body["sudu"]["replica"])
        assert r.headers["x-sudu-route"].startswith(f"replica={body['sudu']['replica']};")
    assert len(replicas) == 2  # distinct prompts, no cached prefix: the load spreads


@pytest.mark.slow
def test_replicas_run_at_nice_0(cluster):
    """Ray starts workers at nice 15, where every process at nice 0 preempts the engine's threads."""
    proc, _ = cluster
    pids = _replica_pids(proc.pid)
    assert len(pids) == 2
    for pid in pids:
        nice = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
        assert nice == 0, (pid, nice)


@pytest.mark.slow
def test_conversations_stay_where_their_prefix_is_cached(cluster):
    _, url = cluster
    sessions = [_tokens(50 * s, 3 * BLOCK) for s in range(4)]
    first_replica = {}
    for turn in range(3):
        for s, history in enumerate(sessions):
            r = _complete(url, history, max_tokens=4)
            assert r.status_code == 200, r.text
            body = r.json()
            timing, usage = body["sudu"], body["usage"]
            if turn == 0:
                first_replica[s] = timing["replica"]
            else:
                assert timing["replica"] == first_replica[s] and timing["route"] == "prefix"
                assert usage["prompt_tokens_details"]["cached_tokens"] >= len(history) - 2 * BLOCK
                predicted, cached = timing["predicted_cached_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
                # turn 1 follows turn 0 at once: the router knows only the blocks it sent (a lower bound); by
                # turn 2 the replicas have reported what they hold, generated blocks included
                assert 0 < predicted <= cached if turn == 1 else predicted == cached
            sessions[s] = history + [7] * 4 + _tokens(200 + 30 * turn + s, BLOCK)
        if turn == 1:
            time.sleep(2.5 * ROUTING_STATS_PERIOD_S)
    metrics = httpx.get(url + "/metrics", timeout=10).text
    hits = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("sudu:prefix_cache_hits"))
    assert hits > 0  # the replicas' counters, summed at the ingress
    per_replica = [line for line in metrics.splitlines() if line.startswith("sudu:replica_prefix_cache_hits_total{")]
    assert len(per_replica) == 2 and sum(float(line.split()[-1]) for line in per_replica) == hits
    assert 'sudu:route_decisions_total{route="prefix"}' in metrics


@pytest.mark.slow
def test_bad_input_is_an_openai_error(cluster):
    _, url = cluster
    r = _complete(url, [10**9])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    r = _complete(url, list(range(1, 50)), max_tokens=MAX_MODEL_LEN)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def _stream(url: str, prompt: list[int], results: dict, key: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    results.setdefault(key + ":started", True)
    finally:
        results[key] = events


@pytest.mark.slow
def test_a_killed_replica_fails_only_its_own_requests_and_comes_back(cluster):
    import threading

    proc, url = cluster
    pids = _replica_pids(proc.pid)
    assert len(pids) == 2
    results: dict = {}
    threads = [threading.Thread(target=_stream, args=(url, list(range(200 + 40 * i, 230 + 40 * i)), results, f"s{i}"),
                                daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(f"s{i}:started" in results for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    ends = []
    for i in range(2):
        events = results[f"s{i}"]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["code"] == "replica_failed" and last["error"]["type"] == "service_unavailable"
            ends.append("failed")
        else:
            ends.append(last["choices"][0]["finish_reason"])
    assert sorted(ends) == ["failed", "length"]  # one stream per replica: only the killed one's failed
    assert _wait_health(url, {"degraded"}, timeout_s=30)["replicas"]["running"] == 1
    _wait_health(url, {"ok"}, timeout_s=180)
    assert _complete(url, list(range(3, 40))).status_code == 200


# ---- prefill/decode handoff ----------------------------------------------------------------------------

def test_handoff_blocks_let_another_engine_decode_as_one_engine(tiny_model_dirs):
    """Without Ray: the prompt's blocks exported from one engine after a one-token prefill and imported
    into another make that engine's prefix match serve all full blocks, and its greedy output is the
    unified engine's."""
    from sudu.cluster.handoff import export_prompt_blocks, import_prompt_blocks
    from sudu.engine.llm import LLM

    kw = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20, disk_cache_size="0")
    prefill, decode, unified = (LLM(str(tiny_model_dirs["llama"]), **kw) for _ in range(3))
    prompt = _tokens(3, 5 * BLOCK + 7)
    params = SamplingParams(max_tokens=12, temperature=0)
    prefill.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    payload = export_prompt_blocks(prefill.engine, prompt)
    assert payload.shape == (5, prefill.engine.block_manager.block_io.nbytes)
    # blocks of another KV format (float16 and bfloat16 have the same bytes) are refused, not misread
    other = LLM(str(tiny_model_dirs["llama"]), **kw, kv_cache_dtype="bfloat16")
    assert other.engine.block_manager.namespace != prefill.engine.block_manager.namespace
    assert import_prompt_blocks(other.engine, prompt, payload, prefill.engine.block_manager.namespace) == 0
    assert import_prompt_blocks(decode.engine, prompt, payload, prefill.engine.block_manager.namespace) == 5
    assert import_prompt_blocks(decode.engine, prompt, payload) == 0  # held already: not written again
    got = decode.generate([prompt], params)[0]
    assert got.num_cached_tokens == 5 * BLOCK
    assert got.outputs[0].token_ids == unified.generate([prompt], params)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="bytes"):
        import_prompt_blocks(decode.engine, prompt, payload[:, :-8])


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dirs, tmp_path_factory):
    yield from _serve(tiny_model_dirs, tmp_path_factory.mktemp("pd") / "serve.log", "--pd", "1:1")


@pytest.mark.slow
def test_pd_split_outputs_equal_one_engine_and_report_the_handoff(pd_cluster, tiny_model_dirs):
    from sudu.engine.llm import LLM

    _, url = pd_cluster
    assert httpx.get(url + "/health", timeout=10).json()["replicas"] == {"running": 2, "target": 2}
    prompts = [_tokens(7 * i, 20 + 9 * i) for i in range(8)]
    llm = LLM(str(tiny_model_dirs["llama"]), max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20,
              quantization="int8")
    expected = _one_engine(llm, prompts)
    for prompt, (want, want_logprobs) in zip(prompts, expected):
        r = _complete(url, prompt, logprobs=0)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == llm.tokenizer.decode(want)
        # the decode replica continued from imported blocks: the same bits as one engine's uncached batch
        assert body["choices"][0]["logprobs"]["token_logprobs"] == want_logprobs
        timing = body["sudu"]
        blocks = (len(prompt) - 1) // BLOCK
        assert timing["handoff_blocks"] == blocks and timing["handoff_imported_blocks"] == blocks
        assert timing["handoff_bytes"] == blocks * llm.engine.block_manager.block_io.nbytes
        assert timing["handoff_s"] > 0 and timing["prefill_replica"] != timing["replica"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK
    stream = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompts[3], "max_tokens": 8,
                                                       "temperature": 0, "stream": True}, timeout=60)
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
