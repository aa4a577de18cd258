"""Overload: an open-loop Poisson load above capacity against `sudu serve`, and what the server does with
it. Admitted requests keep a bounded TTFT, the rest get 429 with Retry-After at once, nothing is lost
(every request ends with a complete answer or an error), and the server's memory stays flat.

1. capacity: closed loop, `--max-num-seqs` clients back to back for `--probe-s` seconds -> completed
   requests per second;
2. overload: Poisson arrivals at `--load` x capacity for `--duration-s` seconds, each a streaming chat
   completion; arrivals never wait for answers (open loop). The run then waits for every request to end.

    flock /tmp/sudu-bench.lock python -m benchmarks.overload [--model M] [--load 2] [--duration-s 60]

Figures and the command that produced them: docs/benchmarks.md, "Overload".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from sudu.bench.local_server import free_port, serve_command, stop_server, wait_for_health

TOPICS = ["binary search", "an LRU cache", "quicksort", "a trie", "Dijkstra's algorithm", "a ring buffer",
          "matrix multiplication", "run-length encoding", "a bloom filter", "merge sort"]


@dataclass
class Outcome:
    kind: str  # "ok" | "rejected" (429) | "error" (another HTTP error or an error event) | "lost"
    status: int | None = None
    retry_after: str | None = None
    ttft_s: float | None = None
    detail: str = ""


@dataclass
class RunResult:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_bytes: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, server RSS)

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)


def request_body(i: int, max_tokens: int) -> dict:
    # salted, so no request is served from another's prefix cache
    content = f"[{i}] Write {TOPICS[i % len(TOPICS)]} in Python, with a docstring."
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def one_request(client: httpx.AsyncClient, url: str, body: dict, timeout_s: float) -> Outcome:
    """A streaming chat completion, classified: a complete answer ends with a finish_reason and [DONE]."""
    start = time.perf_counter()
    ttft, finished = None, False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                await r.aread()
                kind = "rejected" if r.status_code == 429 else "error"
                return Outcome(kind, r.status_code, r.headers.get("retry-after"), detail=r.text[:200])
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return Outcome("ok" if finished else "error", 200, ttft_s=ttft,
                                   detail="" if finished else "[DONE] without a finish_reason")
                event = json.loads(data)
                if "error" in event:
                    return Outcome("error", 200, detail=json.dumps(event["error"])[:200])
                for choice in event.get("choices", []):
                    if choice["delta"].get("content") and ttft is None:
                        ttft = time.perf_counter() - start
                    finished = finished or choice.get("finish_reason") is not None
        return Outcome("lost", 200, detail="the stream ended without [DONE]")
    except (httpx.HTTPError, OSError) as exc:
        return Outcome("lost", detail=f"{type(exc).__name__}: {exc}")


def server_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def open_loop(url: str, rate_per_s: float, duration_s: float, max_tokens: int, seed: int = 0,
                    server_pid: int | None = None, timeout_s: float = 600.0) -> RunResult:
    """Poisson arrivals at rate_per_s for duration_s; returns once every request has ended."""
    rng = random.Random(seed)
    result = RunResult()
    start = time.perf_counter()
    stop_sampling = asyncio.Event()

    async def sample_memory() -> None:
        while server_pid is not None and not stop_sampling.is_set():
            result.rss_bytes.append((time.perf_counter() - start, server_rss_bytes(server_pid)))
            try:
                await asyncio.wait_for(stop_sampling.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    sampler = asyncio.create_task(sample_memory())
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
        tasks = []
        next_at, i = 0.0, 0
        while next_at < duration_s:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, url, request_body(i, max_tokens), timeout_s)))
            i += 1
            next_at += rng.expovariate(rate_per_s)
        result.outcomes = list(await asyncio.gather(*tasks))
    stop_sampling.set()
    await sampler
    return result


async def closed_loop_capacity(url: str, clients: int, seconds: float, max_tokens: int,
                               max_seconds: float = 600.0) -> float:
    """Completed requests per second with `clients` back-to-back clients: over at least `seconds`, and
    until every client has completed two requests (a loaded machine's first answers can take longer)."""
    done = [0] * clients
    start = time.perf_counter()

    async def client_loop(c: int, client: httpx.AsyncClient) -> None:
        i = 0
        while True:
            elapsed = time.perf_counter() - start
            if elapsed > max_seconds or (elapsed > seconds and min(done) >= 2):
                return
            outcome = await one_request(client, url, request_body(10_000 * (c + 1) + i, max_tokens), 600)
            i += 1
            if outcome.kind != "ok":
                raise RuntimeError(f"capacity probe: a request failed ({outcome.kind} {outcome.status}: "
                                   f"{outcome.detail})")
            done[c] += 1

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(client_loop(c, client) for c in range(clients)))
    return sum(done) / (time.perf_counter() - start)


def summarize(result: RunResult, offered_per_s: float, capacity_per_s: float) -> dict:
    ttfts = [o.ttft_s for o in result.outcomes if o.kind == "ok" and o.ttft_s is not None]
    rejected = [o for o in result.outcomes if o.kind == "rejected"]
    summary = {
        "capacity_req_per_s": round(capacity_per_s, 3), "offered_req_per_s": round(offered_per_s, 3),
        "requests": len(result.outcomes), "ok": result.count("ok"), "rejected_429": len(rejected),
        "rejected_with_retry_after": sum(o.retry_after is not None for o in rejected),
        "errors": result.count("error"), "lost": result.count("lost"),
    }
    if ttfts:
        p50, p90, p99 = np.percentile(ttfts, [50, 90, 99])
        summary.update(ttft_p50_s=round(float(p50), 3), ttft_p90_s=round(float(p90), 3),
                       ttft_p99_s=round(float(p99), 3), ttft_max_s=round(max(ttfts), 3))
    if result.rss_bytes:
        rss = [b for _, b in result.rss_bytes]
        half = [b for t, b in result.rss_bytes if t >= result.rss_bytes[-1][0] / 2]
        summary.update(rss_start_mib=round(rss[0] / 2**20, 1), rss_max_mib=round(max(rss) / 2**20, 1),
                       rss_end_mib=round(rss[-1] / 2**20, 1),
                       rss_second_half_range_mib=round((max(half) - min(half)) / 2**20, 1))
    details = sorted({o.detail for o in result.outcomes if o.kind in ("error", "lost")})
    if details:
        summary["error_details"] = details[:5]
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--load", type=float, default=2.0, help="offered rate as a multiple of the measured capacity")
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--probe-s", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-queue-len", type=int, default=8)
    ap.add_argument("--serve-args", default="", help="more `sudu serve` flags")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = f"--max-num-seqs {args.max_num_seqs} --max-queue-len {args.max_queue_len} --log-level warning " \
            + args.serve_args
    log_path = os.path.join(tempfile.gettempdir(), f"sudu-overload-{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve_command(port, args.model, extra), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_health(proc, url, 900, log_path)
        capacity = asyncio.run(closed_loop_capacity(url, args.max_num_seqs, args.probe_s, args.max_tokens))
        offered = args.load * capacity
        result = asyncio.run(open_loop(url, offered, args.duration_s, args.max_tokens, server_pid=proc.pid))
        summary = summarize(result, offered, capacity)
        summary["server_alive"] = proc.poll() is None
    finally:
        stop_server(proc)
    print(json.dumps(summary, indent=2))
    return 0 if summary["lost"] == 0 and summary["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
