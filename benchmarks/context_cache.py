"""Context cache benchmarks (docs/benchmarks.md "Context cache"), on the default model, 2 threads.

1. hash: the cost of stable block ids (blake2b-128 and SHA-256 truncated) over a 4,096-token prompt, next
   to that prompt's measured prefill time in the same process. Target: under 2%.
2. conversation: `sudu bench conversation` (8 users x 10 turns, coding-agent sessions) against `sudu serve`
   with the context cache on (a fresh disk directory) and off (--enable-prefix-caching false), one after
   the other. Prints the token hit rate and the mean TTFT of turns >= 2, on against off. Targets: hit rate
   >= 90%; TTFT of turns >= 2 on <= 15% of off.
3. restart: a 4k-token conversation on one server, stopped (SIGTERM); a new server on the same disk
   directory answers the next turn. Its TTFT against the same prompt recomputed (a fresh salt at the start,
   same server, same length). Target: <= 20% of cold. The same again (after another restart) for a short
   follow-up question on that context instead of the next tool output: what the cache does when the new
   part of the prompt is small. Also prints the disk tier's write and read
   throughput from /metrics next to this disk's own speed (1 GiB written with fsync, read back after
   dropping it from the page cache).

4. index: the disk tier's start-up, rebuilding its index of 50,000 block files from names and stat.

    python -m benchmarks.context_cache [--parts hash,conversation,restart,index] [--users 8] [--turns 10]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sudu.bench.local_server import free_port, stop_server, wait_for_health

MODEL = "qwen2.5-coder-0.5b-instruct"


def part_hash() -> None:
    from sudu.cache.block_hash import block_hash
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams

    print("\n## 1. block ids: hashing cost vs prefill, 4,096 tokens", flush=True)
    llm = LLM(MODEL, progress=False, enable_prefix_caching=False, max_num_batched_tokens=4096)
    ids = [(i * 7919) % 150000 for i in range(4096)]
    llm.generate([ids[:512]], SamplingParams(max_tokens=1))  # warm up
    prefill = []
    for r in range(3):
        prompt = [(t + r) % 150000 for t in ids]
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1))
        prefill.append(time.perf_counter() - t0)
    prefill_s = min(prefill)

    def sha(parent, tokens):
        return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens)).digest()[:16]

    for name, fn in (("blake2b-128", block_hash), ("sha256/128", sha)):
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            parent = bytes(16)
            for b in range(4096 // 16):
                parent = fn(parent, ids[b * 16:(b + 1) * 16])
            best = min(best, time.perf_counter() - t0)
        print(f"{name}: {best * 1e3:.3f} ms for 256 blocks = {100 * best / prefill_s:.3f}% of the prefill "
              f"({prefill_s:.2f} s)", flush=True)


def part_index(num_files: int) -> None:
    """Start-up cost of the disk tier: the index is rebuilt from file names and stat alone."""
    import torch

    from sudu.cache.block_hash import block_hash
    from sudu.cache.disk_store import DiskKVStore

    print(f"\n## 4. disk index rebuild at start: {num_files:,} block files", flush=True)
    root = Path(tempfile.mkdtemp(prefix="sudu-kv-index-"))
    try:
        ns = bytes(16)
        store = DiskKVStore(root, ns, payload_nbytes=64, max_bytes=1 << 40, queue_bytes=1 << 40)
        parent = ns
        for i in range(num_files):
            h = block_hash(parent if i % 50 else ns, (i,))  # chains of 50 blocks
            store.put(h, parent if i % 50 else ns, (i,), torch.zeros(64, dtype=torch.uint8))
            parent = h
        store.flush(timeout_s=1800)
        store.close()
        t0 = time.perf_counter()
        again = DiskKVStore(root, ns, payload_nbytes=64, max_bytes=1 << 40)
        print(f"rebuilt {again.num_blocks:,} entries in {1e3 * (time.perf_counter() - t0):.0f} ms", flush=True)
        again.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def start_server(port: int, cache_dir: str, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sudu.cli", "serve", MODEL, "--port", str(port), "--disk-cache-dir", cache_dir,
           "--log-level", "warning", *extra]
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    wait_for_health(proc, f"http://127.0.0.1:{port}", 900, str(log))
    return proc


def run_conversation_bench(label: str, serve_args: str, out: Path, users: int, turns: int) -> dict:
    cmd = [sys.executable, "-m", "sudu.cli", "bench", "conversation", "--model", MODEL, "--users", str(users),
           "--turns", str(turns), "--out", str(out / label), "--no-html", "--serve-args", serve_args]
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    report = json.load(open(sorted((out / label).glob("conversation-*.json"))[-1]))
    return report["conversation"]


def part_conversation(users: int, turns: int, out: Path) -> None:
    print(f"\n## 2. conversation suite: {users} users x {turns} turns, cache on vs off", flush=True)
    cache_dir = tempfile.mkdtemp(prefix="sudu-kv-bench-")
    try:
        on = run_conversation_bench("on", f"--disk-cache-dir {cache_dir}", out, users, turns)
        off = run_conversation_bench("off", "--enable-prefix-caching false", out, users, turns)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print("| turn | prompt tokens | TTFT on ms (mean) | TTFT off ms (mean) | on/off | cached share on |")
    print("|---:|---:|---:|---:|---:|---:|")
    for a, b in zip(on["turns"], off["turns"]):
        ratio = a["ttft_mean_s"] / b["ttft_mean_s"] if a["ttft_mean_s"] and b["ttft_mean_s"] else float("nan")
        print(f"| {a['turn']} | {a['prompt_tokens_mean']:.0f} | {1e3 * a['ttft_mean_s']:.0f} | "
              f"{1e3 * b['ttft_mean_s']:.0f} | {ratio:.3f} | {100 * (a['cached_share'] or 0):.1f}% |")
    ratio = on["ttft_mean_turns_2plus_s"] / off["ttft_mean_turns_2plus_s"]
    print(f"token hit rate (turns >= 2): on {100 * on['token_hit_rate_turns_2plus']:.1f}% "
          f"(all turns {100 * on['token_hit_rate_all']:.1f}%); off {100 * (off['token_hit_rate_turns_2plus'] or 0):.1f}%")
    print(f"mean TTFT of turns >= 2: on {1e3 * on['ttft_mean_turns_2plus_s']:.0f} ms, off "
          f"{1e3 * off['ttft_mean_turns_2plus_s']:.0f} ms: on/off = {ratio:.3f} (target <= 0.15)")
    print(f"session time mean: on {on['session_s_mean']:.1f} s, off {off['session_s_mean']:.1f} s "
          f"({off['session_s_mean'] / on['session_s_mean']:.2f}x)", flush=True)


def chat(client: httpx.Client, url: str, messages: list[dict], max_tokens: int = 32) -> tuple[float, str, dict]:
    """(TTFT s, text, usage) of one streamed chat request."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage, sudu = None, "", {}, {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    text += piece
                if c.get("finish_reason") and chunk.get("sudu"):
                    sudu = chunk["sudu"]
            usage = chunk.get("usage") or usage
            sudu = chunk.get("sudu") or sudu
    return ttft, text, {**usage, "sudu": sudu}


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{re.escape(name)}(?:_total)? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def disk_speed_gbs(directory: str, size: int = 1 << 30) -> tuple[float, float]:
    """(write GB/s with fsync, read GB/s after dropping the file from the page cache) of 1 GiB here."""
    path = os.path.join(directory, "speed.bin")
    block = os.urandom(1 << 22)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = size / (time.perf_counter() - t0) / 1e9
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    while os.read(fd, 1 << 22):
        pass
    read = size / (time.perf_counter() - t0) / 1e9
    os.close(fd)
    os.unlink(path)
    return write, read


def part_restart(out: Path) -> None:
    from sudu.bench.conversation import make_sessions, tool_output

    print("\n## 3. restart: the next turn of a 4k-token conversation, served from disk vs recomputed", flush=True)
    cache_dir = tempfile.mkdtemp(prefix="sudu-kv-bench-")
    log = out / "restart-serve.log"
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    session = make_sessions(1, 1, seed=3)[0]
    messages = list(session.messages)
    proc = start_server(port, cache_dir, [], log)
    try:
        with httpx.Client(timeout=600) as client:
            turn = 0
            while True:
                turn += 1
                _, text, usage = chat(client, url, messages)
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": tool_output(session.rng, "read_file", session.noun, turn, 400)}]
                if usage["prompt_tokens"] >= 3600:
                    break
            time.sleep(1.0)
            written = metric(url, "sudu:disk_cache_written_bytes")
            write_s = metric(url, "sudu:disk_cache_write_seconds")
        # the continued turn as the workload makes it (a new tool output), then a short follow-up question
        # on the same context: each first after a restart, so the context comes from disk
        follow_up = messages[:-1] + [{"role": "user", "content": "In one sentence: what does the file above do?"}]
        read = read_s = 0.0
        for label, turn_messages in (("next turn (a new tool output)", messages), ("short follow-up", follow_up)):
            stop_server(proc)
            proc = start_server(port, cache_dir, [], log)
            with httpx.Client(timeout=600) as client:
                ttft_disk, _, usage = chat(client, url, turn_messages)
                read += metric(url, "sudu:disk_cache_read_bytes")
                read_s += metric(url, "sudu:disk_cache_read_seconds")
                cold = []
                for r in range(3):
                    first = turn_messages[0]
                    salted = [{**first, "content": f"[cold {r} {time.time()}] " + first["content"]}] + turn_messages[1:]
                    cold.append(chat(client, url, salted)[0])
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            print(f"{label}: prompt {usage['prompt_tokens']} tokens, {cached} cached "
                  f"({usage['sudu'].get('cached_tokens_disk')} from disk, loaded in "
                  f"{1e3 * usage['sudu'].get('disk_load_s', 0):.1f} ms), {usage['prompt_tokens'] - cached} computed")
            cold_s = sorted(cold)[1]
            print(f"  TTFT after restart {1e3 * ttft_disk:.0f} ms vs recomputed {1e3 * cold_s:.0f} ms (median of 3: "
                  f"{', '.join(f'{1e3 * c:.0f}' for c in cold)}): {ttft_disk / cold_s:.3f} of cold (target <= 0.20)",
                  flush=True)
        wr, rd = disk_speed_gbs(cache_dir)
        print(f"disk tier: wrote {written / 1e6:.1f} MB at {written / max(write_s, 1e-9) / 1e9:.2f} GB/s (writer "
              f"thread), read {read / 1e6:.1f} MB at {read / max(read_s, 1e-9) / 1e9:.2f} GB/s (reads + checks); "
              f"this disk: {wr:.2f} GB/s write (fsync), {rd:.2f} GB/s read (page cache dropped)", flush=True)
    finally:
        stop_server(proc)
        shutil.rmtree(cache_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="hash,conversation,restart,index")
    ap.add_argument("--index-files", type=int, default=50000)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--out", default="bench-results/context-cache")
    args = ap.parse_args()
    parts = {p.strip() for p in args.parts.split(",")}
    out = Path(args.out)
    if "hash" in parts:
        part_hash()
    if "conversation" in parts:
        part_conversation(args.users, args.turns, out)
    if "restart" in parts:
        part_restart(out)
    if "index" in parts:
        part_index(args.index_files)


if __name__ == "__main__":
    main()
