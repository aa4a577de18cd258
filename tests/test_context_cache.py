"""The context cache as a system: block ids that are the same in any process, a disk tier whose hits
compute exactly what RAM hits compute, that survives restarts, bad files, a full budget and a killed
writer, and prefix caching for Gemma's sliding-window layers in the default (bounded) layout."""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sudu.cache import disk_store as DS
from sudu.cache.block_hash import block_hash, make_namespace, prefix_hashes
from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams
from tests.helpers.greedy import GREEDY, prompts_of, reference_greedy
from tests.helpers.tiny_models import build_hf_model

PARAMS = SamplingParams(max_tokens=12, logprobs=1, **GREEDY)


def disk_llm(model_dir, cache_dir, size="64MiB", **cfg):
    return LLM(str(model_dir), progress=False, disk_cache_size=size, disk_cache_dir=str(cache_dir), **cfg)


def tokens_and_logprobs(results):
    return [(r.token_ids, [t.logprob for t in r.outputs[0].logprobs]) for r in results]


def kv_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


# ---- identity ---------------------------------------------------------------------------------------

IDS_SCRIPT = """
import json, sys
from sudu.engine.llm import LLM
from sudu.engine.sequence import Sequence
from sudu.sampling import SamplingParams
llm = LLM(sys.argv[1], progress=False)
seq = Sequence("r", 0, list(range(3, 70)), 67, SamplingParams(), 0, 0.0, 100)
bm = llm.engine.block_manager
print(json.dumps([bm.namespace.hex()] + [h.hex() for h in bm.hashes(seq, 4)]))
"""


def test_block_ids_are_the_same_in_separate_processes(tiny_model_dirs):
    """Two fresh interpreters with different hash seeds (Python's hash() differs between them) name the
    same prompt's blocks alike, and so does this process."""
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.getcwd())
        proc = subprocess.run([sys.executable, "-c", IDS_SCRIPT, str(tiny_model_dirs["qwen2"])], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    assert len(set(outs[0])) == 5
    ns = bytes.fromhex(outs[0][0])
    assert [h.hex() for h in prefix_hashes(ns, list(range(3, 70)), 16, 4)] == outs[0][1:]


def test_namespace_names_everything_that_changes_kv_bytes(tiny_model_dirs, tmp_path):
    from tests.helpers.tiny_models import save_tiny_model

    def ns(model="qwen2", **cfg):
        path = tiny_model_dirs[model] if model in tiny_model_dirs else model
        return LLM(str(path), progress=False, kv_cache_memory=4 << 20, **cfg).engine.block_manager.namespace

    base = ns()
    assert ns() == base
    moved = tmp_path / "elsewhere"
    shutil.copytree(tiny_model_dirs["qwen2"], moved)
    assert ns(str(moved)) == base  # the same weights at another path (another machine's layout)
    other_weights = save_tiny_model(tmp_path / "qwen2-seed1", "qwen2", seed=1)
    # auto's choice is int8 or 16-bit: float32 and bfloat16 differ from it either way
    changed = [ns(block_size=32), ns(kv_cache_dtype="float32"), ns(kv_cache_dtype="bfloat16"), ns(quantization="int8"),
               ns(str(other_weights)), ns("llama")]
    assert len({base, *changed}) == 1 + len(changed)
    # ids chain through the parent: the same block after different parents differs
    assert block_hash(base, (1, 2, 3)) != block_hash(block_hash(base, (0,)), (1, 2, 3))
    assert make_namespace({"a": 1}) == make_namespace({"a": 1}) != make_namespace({"a": 2})


# ---- the disk tier through the engine ---------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_disk_hit_computes_what_a_ram_hit_and_no_cache_compute(tiny_model_dirs, tmp_path, arch):
    """A new engine on the same directory (a restart) serves the prompts from disk: greedy tokens equal
    the uncached run's, and every logprob equals the RAM hit's bit for bit."""
    prompts = prompts_of([40, 90, 130], seed=5)
    uncached = LLM(str(tiny_model_dirs[arch]), progress=False, enable_prefix_caching=False).generate(prompts, PARAMS)
    first = disk_llm(tiny_model_dirs[arch], tmp_path)
    first.generate(prompts, PARAMS)
    ram = first.generate(prompts, PARAMS)
    assert [r.num_cached_tokens for r in ram] == [32, 80, 128] and not any(r.num_cached_tokens_disk for r in ram)
    first.close()
    restarted = disk_llm(tiny_model_dirs[arch], tmp_path)
    disk = restarted.generate(prompts, PARAMS)
    assert [(r.num_cached_tokens, r.num_cached_tokens_disk) for r in disk] == [(32, 32), (80, 80), (128, 128)]
    assert all(r.metrics.disk_load_s > 0 for r in disk)
    assert [t for t, _ in tokens_and_logprobs(disk)] == [r.token_ids for r in uncached]
    assert tokens_and_logprobs(disk) == tokens_and_logprobs(ram)
    stats = restarted.engine.stats()
    assert stats["disk_cache_hits"] == 15 and stats["prefix_cache_hits_disk"] == 240


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3moe"])
def test_disk_hit_on_latent_and_expert_models(tmp_path, arch):
    """The disk tier carries any pool layout: DeepSeek's latent entries (V wider than K) and a MoE model."""
    from tests.helpers.tiny_models import save_tiny_model

    model_dir = save_tiny_model(tmp_path / arch, arch)
    prompts = prompts_of([40, 70], seed=18)
    uncached = LLM(str(model_dir), progress=False, enable_prefix_caching=False).generate(prompts, PARAMS)
    first = disk_llm(model_dir, tmp_path / "kv")
    first.generate(prompts, PARAMS)
    first.close()
    disk = disk_llm(model_dir, tmp_path / "kv").generate(prompts, PARAMS)
    assert [r.num_cached_tokens_disk for r in disk] == [32, 64]
    assert [r.token_ids for r in disk] == [r.token_ids for r in uncached]


def test_ram_misses_continue_on_disk_after_eviction(tiny_model_dirs, tmp_path):
    """A pool too small to keep earlier prompts: their blocks come back from disk, not recomputation."""
    llm = disk_llm(tiny_model_dirs["qwen2"], tmp_path, kv_cache_memory=24 * 16 * 512,  # 24 blocks
                   kv_cache_dtype="float32")
    prompts = prompts_of([150, 150, 150], seed=6)
    ref = [r.token_ids for r in llm.generate(prompts, PARAMS)]
    llm.engine.block_manager.disk.flush()
    again = llm.generate(prompts[:1], PARAMS)[0]
    assert again.num_cached_tokens == 144 and again.num_cached_tokens_disk > 0
    assert again.token_ids == ref[0]


def test_bad_files_are_misses_never_inputs(tiny_model_dirs, tmp_path, caplog):
    """Truncated, bit-flipped, deleted and foreign-namespace files: each is a miss (recomputed, the same
    tokens), is replaced, and is logged once; the engine keeps serving."""
    prompts = prompts_of([100, 100, 100, 100], seed=7)
    writer = disk_llm(tiny_model_dirs["llama"], tmp_path)
    ref = tokens_and_logprobs(writer.generate(prompts, PARAMS))
    writer.close()
    ns_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    roots = [f for f in kv_files(tmp_path) if f.name.split("-")[1].removesuffix(".kv") == ns_dir.name]
    assert len(roots) == 4  # one first block per prompt

    def first_block_of(i):
        return next(f for f in roots if f.name.split("-")[0] == writer.engine.block_manager.hashes(
            _seq(prompts[i]), 1)[0].hex())

    truncated, flipped, deleted, foreign = (first_block_of(i) for i in range(4))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    blob = bytearray(flipped.read_bytes())
    blob[-5] ^= 0x40
    flipped.write_bytes(bytes(blob))
    other = bytearray(foreign.read_bytes())
    other[12:28] = bytes(16)  # the header's namespace
    foreign.write_bytes(bytes(other))
    reader = disk_llm(tiny_model_dirs["llama"], tmp_path)
    deleted.unlink()  # after the index was built: a file that vanishes mid-run
    with caplog.at_level(logging.WARNING, logger="sudu.cache.disk_store"):
        got = reader.generate(prompts, PARAMS)
    assert tokens_and_logprobs(got) == ref
    assert [r.num_cached_tokens for r in got] == [0, 0, 0, 0]
    stats = reader.engine.stats()
    assert stats["disk_cache_corrupt_dropped"] == 3
    assert sum("dropped" in r.getMessage() for r in caplog.records) == 1
    reader.close()  # the recomputed blocks were written again, whole
    healed = disk_llm(tiny_model_dirs["llama"], tmp_path)
    assert [r.num_cached_tokens_disk for r in healed.generate(prompts, PARAMS)] == [96] * 4
    assert healed.engine.stats()["disk_cache_corrupt_dropped"] == 0


def _seq(token_ids):
    from sudu.engine.sequence import Sequence

    return Sequence("x", 0, list(token_ids), len(token_ids), SamplingParams(), 0, 0.0, len(token_ids) + 1)


def test_full_budget_evicts_and_output_stays_exact(tiny_model_dirs, tmp_path):
    llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False)
    block_bytes = llm.engine.block_manager.block_io.nbytes
    budget = 10 * (block_bytes + 400)
    small = disk_llm(tiny_model_dirs["qwen2"], tmp_path, size=str(budget))
    prompts = prompts_of([100] * 6, seed=8)
    ref = [r.token_ids for r in llm.generate(prompts, PARAMS)]
    assert [r.token_ids for r in small.generate(prompts, PARAMS)] == ref
    disk = small.engine.block_manager.disk
    disk.flush()
    assert disk.stats.evictions > 0
    assert sum(f.stat().st_size for f in kv_files(tmp_path)) <= budget


def test_writer_falling_behind_drops_blocks_instead_of_waiting(tiny_model_dirs, tmp_path):
    llm = disk_llm(tiny_model_dirs["qwen2"], tmp_path)
    disk = llm.engine.block_manager.disk
    disk.queue_bytes = llm.engine.block_manager.block_io.nbytes  # room for one queued block
    ref = LLM(str(tiny_model_dirs["qwen2"]), progress=False).generate(prompts_of([200], seed=9), PARAMS)
    got = llm.generate(prompts_of([200], seed=9), PARAMS)
    assert got[0].token_ids == ref[0].token_ids
    assert disk.stats.writes_dropped > 0


def test_unusable_directory_warns_once_and_serves_without_the_disk_tier(tiny_model_dirs, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        llm = disk_llm(tiny_model_dirs["qwen2"], blocker / "kv")
    assert llm.engine.block_manager.disk is None
    assert sum("disk KV cache off" in r.getMessage() for r in caplog.records) == 1
    assert llm.generate(prompts_of([20], seed=1), PARAMS)[0].finish_reason == "length"
    assert llm.engine.stats()["disk_cache_enabled"] == 0


def test_a_full_disk_shrinks_the_budget_and_keeps_serving(tiny_model_dirs, tmp_path, monkeypatch):
    llm = disk_llm(tiny_model_dirs["qwen2"], tmp_path)
    disk = llm.engine.block_manager.disk
    real_replace = os.replace

    def full(src, dst):
        if str(dst).endswith(".kv") and disk.stats.blocks_written >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(DS.os, "replace", full)
    got = llm.generate(prompts_of([100], seed=10), PARAMS)[0]
    disk.flush()
    assert got.finish_reason == "length"
    assert disk.stats.write_errors > 0 and disk.total_bytes <= disk.max_bytes < 64 << 20
    assert not list(tmp_path.rglob(".tmp-*"))


KILL_SCRIPT = """
import sys
from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams
llm = LLM(sys.argv[1], progress=False, disk_cache_size="256MiB", disk_cache_dir=sys.argv[2])
disk = llm.engine.block_manager.disk
orig = disk._write
def slow_write(w):
    orig(w)
    print("wrote", flush=True)
disk._write = slow_write
import random
g = random.Random(11)
while True:
    llm.generate([[g.randrange(380) for _ in range(300)]], SamplingParams(max_tokens=2, temperature=0))
"""


def test_sigkill_during_writes_leaves_a_usable_cache(tiny_model_dirs, tmp_path):
    """A server killed with SIGKILL while writing: the next start removes its half-written temporary
    files, and every block it then reads is whole (or dropped as a miss), so outputs stay exact."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tiny_model_dirs["qwen2"]), str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        written = 0
        deadline = time.monotonic() + 240
        while written < 40 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            written += line.startswith("wrote")
        assert written >= 40, proc.stderr.read()[-2000:] if proc.poll() is not None else "too slow"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    # a half-written file as the kill leaves it (the kill may or may not have landed mid-write)
    some = kv_files(tmp_path)[0]
    (some.parent / f".tmp-{proc.pid}-1-{some.name.split('-')[0]}").write_bytes(some.read_bytes()[:1000])
    import random

    g = random.Random(11)
    prompts = [[g.randrange(380) for _ in range(300)] for _ in range(3)]
    reader = disk_llm(tiny_model_dirs["qwen2"], tmp_path, size="256MiB")
    assert not list(tmp_path.rglob(".tmp-*"))
    got = reader.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    ref = LLM(str(tiny_model_dirs["qwen2"]), progress=False).generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert got[0].num_cached_tokens_disk > 0


def test_two_engines_share_one_directory(tiny_model_dirs, tmp_path):
    """Both start on an empty directory; what one writes, the other finds (its index learns of the file
    when a lookup reaches it); a third engine reads what both wrote."""
    a = disk_llm(tiny_model_dirs["qwen2"], tmp_path)
    b = disk_llm(tiny_model_dirs["qwen2"], tmp_path)
    prompts = prompts_of([80, 120], seed=12)
    ref = a.generate(prompts, PARAMS)
    a.close()
    got = b.generate(prompts, PARAMS)
    assert [r.num_cached_tokens_disk for r in got] == [64, 112]
    assert tokens_and_logprobs(got) == tokens_and_logprobs(ref)
    b.generate(prompts_of([90], seed=13), PARAMS)
    b.close()
    c = disk_llm(tiny_model_dirs["qwen2"], tmp_path)
    assert [r.num_cached_tokens_disk for r in c.generate(prompts + prompts_of([90], seed=13), PARAMS)] == [64, 112, 80]
    assert c.engine.stats()["disk_cache_corrupt_dropped"] == 0


# ---- the store alone ---------------------------------------------------------------------------------

def _store(root, size, ns=b"n" * 16):
    return DS.DiskKVStore(root, ns, payload_nbytes=64, max_bytes=size)


def _chain(ns, n, start=0):
    out, parent = [], ns
    for i in range(n):
        h = block_hash(parent, (start + i,))
        out.append((h, parent, (start + i,)))
        parent = h
    return out


def test_eviction_drops_leaves_before_their_prefixes_and_survives_restart(tmp_path):
    ns = b"n" * 16
    file_bytes = DS.HEADER.size + 4 + 64
    store = _store(tmp_path, 4 * file_bytes, ns)
    trunk = _chain(ns, 3)
    for h, p, ids in trunk:
        store.put(h, p, ids, torch.full((64,), 1, dtype=torch.uint8))
    store.flush()
    store.touch([(h, p) for h, p, _ in reversed(trunk)])  # the trunk was just used
    branch = _chain(trunk[1][0], 2, start=100)  # hangs off the trunk's second block
    for h, p, ids in branch:
        store.put(h, p, ids, torch.full((64,), 2, dtype=torch.uint8))
    store.flush()
    kept = {h for h, _, _ in trunk + branch if store.has(h)}
    # five files, room for four: the least recently used leaf goes (the trunk's tail), never a parent
    assert kept == {h for h, _, _ in trunk[:2] + branch}
    store.close()
    time.sleep(0.01)
    again = _store(tmp_path, 4 * file_bytes, ns)
    assert again.num_blocks == 4 and again.total_bytes == 4 * file_bytes
    assert all(again.has(h) for h in kept)
    h, p, ids = branch[-1]
    assert bytes(again.load(h, p, ids)) == bytes([2]) * 64
    assert again.load(h, p, (5,)) is None and again.stats.corrupt_dropped == 1  # other tokens: dropped


def test_cache_cli_info_and_clear(tiny_model_dirs, tmp_path, capsys):
    from sudu.cli import main

    llm = disk_llm(tiny_model_dirs["qwen2"], tmp_path)
    llm.generate(prompts_of([50], seed=14), PARAMS)
    llm.close()
    assert main(["cache", "info", "--disk-cache-dir", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["namespaces"][0]["blocks"] == 3 and info["namespaces"][0]["description"]["block_size"] == 16
    assert main(["cache", "clear", "--disk-cache-dir", str(tmp_path)]) == 0
    assert not kv_files(tmp_path)
    assert main(["cache", "info", "--disk-cache-dir", str(tmp_path / "missing")]) == 0


# ---- hybrid models ------------------------------------------------------------------------------------

def test_gemma_prefix_cache_in_the_default_layout_is_exact_and_bounded(tiny_model_dirs):
    """Gemma 3 with its sliding layers in their own bounded pool: a repeated prompt and a prompt sharing
    a prefix are served from the cache (global blocks + the window's sliding blocks), the tokens equal
    the transformers reference, and no sequence ever holds more sliding blocks than its window needs."""
    hf = build_hf_model("gemma3", seed=0)
    # a float32 pool: the tokens are compared with transformers' float32
    llm = LLM(str(tiny_model_dirs["gemma3"]), progress=False, max_num_batched_tokens=16, kv_cache_dtype="float32")
    bm = llm.engine.block_manager
    assert bm.sliding is not None and bm.enable_prefix_caching
    base = prompts_of([100], seed=15)[0]
    prompts = [base, base, base[:70] + prompts_of([30], seed=16)[0]]
    params = SamplingParams(max_tokens=10, **GREEDY)
    eng, results, cached, peak = llm.engine, {}, {}, 0
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, params)
        while eng.has_unfinished():
            for out in eng.step():
                results.setdefault(out.request_id, []).extend(t for o in out.outputs for t in o.token_ids)
                cached[out.request_id] = out.num_cached_tokens
            peak = max([peak] + [bm.sliding.num_held(s) for s in eng.scheduler.running])
    assert [cached[f"g{i}"] for i in range(3)] == [0, 96, 64]
    assert [results[f"g{i}"] for i in range(3)] == [reference_greedy(hf, p, 10) for p in prompts]
    assert peak <= bm.sliding.ring_blocks
    assert bm.sliding.pool.num_free == bm.sliding.num_blocks


# ---- the server across a restart ----------------------------------------------------------------------

def _serve(model_dir, port, cache_dir):
    from sudu.bench.local_server import wait_for_health

    cmd = [sys.executable, "-m", "sudu.cli", "serve", str(model_dir), "--port", str(port), "--max-model-len", "1024",
           "--disk-cache-dir", str(cache_dir), "--served-model-name", "m", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=os.getcwd()), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_health(proc, f"http://127.0.0.1:{port}", 300)
    return proc


def test_a_conversation_continues_from_disk_after_a_restart(tiny_model_dirs, tmp_path):
    """serve (the disk tier is on by default), two turns, SIGTERM, serve again, a third turn: its cached
    tokens cover the earlier turns, loaded from disk, as usage, the timing extension and /metrics say."""
    import httpx

    from sudu.bench.local_server import free_port, stop_server

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    messages = [{"role": "system", "content": "You are a coding agent. " * 8},
                {"role": "user", "content": "Read the file and fix the failing test. " * 4}]

    def turn(client):
        r = client.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 8,
                                                             "temperature": 0})
        r.raise_for_status()
        body = r.json()
        messages.extend([{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "Tool result (run_tests): 1 failed, 12 passed. " * 3}])
        return body

    proc = _serve(tiny_model_dirs["qwen2"], port, tmp_path)
    try:
        with httpx.Client(timeout=120) as client:
            turn(client)
            second = turn(client)
        stop_server(proc)
        proc = _serve(tiny_model_dirs["qwen2"], port, tmp_path)
        with httpx.Client(timeout=120) as client:
            third = turn(client)
            metrics = client.get(f"{url}/metrics").text
    finally:
        stop_server(proc)
    usage, timing = third["usage"], third["sudu"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= second["usage"]["prompt_tokens"] - 16
    assert usage["prompt_cache_hit_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert timing["cached_tokens_disk"] == timing["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert timing["disk_load_s"] > 0
    hits = re.search(r'^sudu:prefix_cache_tier_hits_total\{tier="disk"\} (\S+)$', metrics, re.M)
    assert float(hits.group(1)) == timing["cached_tokens_disk"]


def test_block_payload_is_slot_major_whatever_the_pool_layout():
    """The CPU pools keep each kv head's rows together (layers/kv_cache.py kv_pool); a block's payload is its
    values slot by slot as a slot-major pool holds them, so disk entries do not depend on the layout, and a
    payload scattered into another block reads back the same."""
    from sudu.cache.block_io import KVBlockIO
    from sudu.layers.kv_cache import KVCache

    g = torch.Generator().manual_seed(5)
    bs, blocks, heads, dim = 4, 6, 3, 8
    caches = [KVCache(bs * blocks, heads, dim, torch.float16) for _ in range(2)]
    assert caches[0].k.stride() == (dim, bs * blocks * dim, 1)  # heads apart, as the kernels read it
    for c in caches:
        c.k.copy_(torch.randn(c.k.shape, generator=g).half())
        c.v.copy_(torch.randn(c.v.shape, generator=g).half())
    io = KVBlockIO(caches, set(), bs)
    payload = io.gather([4, 1], [])
    for row, b in enumerate((4, 1)):
        want = torch.cat([t[bs * b:bs * (b + 1)].contiguous().view(-1).view(torch.uint8)
                          for c in caches for t in (c.k, c.v)])
        assert torch.equal(payload[row], want)
    io.scatter(payload[0].numpy().tobytes(), 2, None)
    for t in (t for c in caches for t in (c.k, c.v)):
        assert torch.equal(t[2 * bs:3 * bs], t[4 * bs:5 * bs])
