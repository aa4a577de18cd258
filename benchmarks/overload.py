"""Overload: an open-loop Poisson load above capacity against `sudu serve`, and what the server does with
it. Admitted requests keep a bounded TTFT (admission by predicted wait, `--max-queue-wait`), the rest get
429 with a Retry-After that, obeyed, gets them in; continuing sessions' turns go before cold first turns;
nothing is lost (every request ends with a complete answer or an error), and memory stays flat.

The work is a mix of agent sessions: a cold first turn (a long context no other session shares) or the
next turn of a session whose previous turn has been answered (its prompt: the previous one, the answer and
a short new message, so mostly in the context cache).

1. capacity: closed loop, `--max-num-seqs` clients, each running two-turn sessions (one cold, one
   continuing) back to back for `--probe-s` seconds -> completed requests per second;
2. for each of `--loads` (multiples of that capacity): Poisson arrivals for `--duration-s` seconds, each a
   streaming chat completion, half of them (`--continuing-share`) continuing a session; arrivals never
   wait for answers (open loop). A request refused with 429 waits its Retry-After and is sent once more
   (`--no-retry`: not). The run waits for every request to end; the server's RSS and its KV pools'
   resident bytes are sampled every second.

    flock /tmp/sudu-bench.lock python -m benchmarks.overload [--model M] [--loads 1.5,2,4] [--duration-s 60]

Figures and the command that produced them: docs/benchmarks.md, "Overload".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
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
    text: str = ""  # the answer
    turn: str = "cold"  # "cold" (a session's first turn) | "continuing"
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    retry: "Outcome | None" = None  # the second try after a 429, when its Retry-After was obeyed


@dataclass
class RunResult:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_bytes: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, server RSS)
    kv_resident_bytes: list[tuple[float, int]] = field(default_factory=list)  # from /metrics

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)


def request_body(i: int, max_tokens: int) -> dict:
    # salted, so no request is served from another's prefix cache
    content = f"[{i}] Write {TOPICS[i % len(TOPICS)]} in Python, with a docstring."
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


SESSION_CONTEXT = ("You are a coding agent working in a repository. The task: refactor the module below so that "
                   "each function does one thing, keep the public names, and explain each change in one line. "
                   "Tools: read_file(path), write_file(path, text), run_tests(). ") * 3


# salts every session of this run: a server's context cache (its disk tier too) keeps earlier runs' and
# earlier loads' sessions, which a cold turn must not find
RUN_SALT = secrets.token_hex(4)


def cold_turn(session: int, max_tokens: int) -> dict:
    """A session's first turn: a long context, salted at its start so that no other session shares it."""
    content = f"[run {RUN_SALT} session {session}] {SESSION_CONTEXT} Start with {TOPICS[session % len(TOPICS)]}."
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def next_turn(previous: dict, answer: str, turn: int) -> dict:
    """The session's next turn: its previous prompt and answer (cached), and a short new message."""
    messages = previous["messages"] + [{"role": "assistant", "content": answer},
                                       {"role": "user", "content": f"Turn {turn}: the tests pass. Go on."}]
    return {**previous, "messages": messages}


async def one_request(client: httpx.AsyncClient, url: str, body: dict, timeout_s: float) -> Outcome:
    """A streaming chat completion, classified: a complete answer ends with a finish_reason and [DONE]."""
    start = time.perf_counter()
    ttft, finished, text, cached = None, False, [], None
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
                                   detail="" if finished else "[DONE] without a finish_reason",
                                   text="".join(text), cached_tokens=cached)
                event = json.loads(data)
                if "error" in event:
                    return Outcome("error", 200, detail=json.dumps(event["error"])[:200])
                if event.get("usage"):
                    cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        text.append(choice["delta"]["content"])
                        if ttft is None:
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


def kv_resident_from_metrics(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("sudu:memory_kv_resident_bytes "):
            return int(float(line.split()[1]))
    return None


class Sessions:
    """The open loop's sessions: each arrival continues a session whose last turn was answered (with
    probability continuing_share, when there is one) or starts a new one."""

    def __init__(self, salt: int, max_tokens: int, continuing_share: float, rng: random.Random):
        self.salt, self.max_tokens, self.share, self.rng = salt, max_tokens, continuing_share, rng
        self.idle: list[tuple[dict, str, int]] = []  # (last body, its answer, turns so far)
        self.count = 0

    def next_body(self) -> tuple[dict, str, int]:
        if self.idle and self.rng.random() < self.share:
            body, answer, turns = self.idle.pop(self.rng.randrange(len(self.idle)))
            return next_turn(body, answer, turns + 1), "continuing", turns + 1
        self.count += 1
        if not self.share:  # no sessions: short single requests
            return request_body(self.salt + self.count, self.max_tokens), "cold", 1
        return cold_turn(self.salt + self.count, self.max_tokens), "cold", 1

    def answered(self, body: dict, outcome: Outcome, turns: int) -> None:
        if outcome.kind == "ok":
            self.idle.append((body, outcome.text, turns))


async def request_with_retry(client, url: str, body: dict, timeout_s: float, retry: bool) -> Outcome:
    outcome = await one_request(client, url, body, timeout_s)
    if retry and outcome.kind == "rejected" and outcome.retry_after is not None:
        await asyncio.sleep(float(outcome.retry_after))
        outcome.retry = await one_request(client, url, body, timeout_s)
    return outcome


async def open_loop(url: str, rate_per_s: float, duration_s: float, max_tokens: int, seed: int = 0,
                    server_pid: int | None = None, timeout_s: float = 600.0, continuing_share: float = 0.0,
                    retry: bool = False) -> RunResult:
    """Poisson arrivals at rate_per_s for duration_s; returns once every request has ended (with
    continuing_share 0: every request a cold first turn)."""
    rng = random.Random(seed)
    sessions = Sessions(1_000_000 * (seed + 1), max_tokens, continuing_share, rng)
    result = RunResult()
    start = time.perf_counter()
    stop_sampling = asyncio.Event()

    async def sample_memory(client: httpx.AsyncClient) -> None:
        while server_pid is not None and not stop_sampling.is_set():
            t = time.perf_counter() - start
            result.rss_bytes.append((t, server_rss_bytes(server_pid)))
            try:
                kv = kv_resident_from_metrics((await client.get(url + "/metrics", timeout=10)).text)
                if kv is not None:
                    result.kv_resident_bytes.append((t, kv))
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop_sampling.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def turn(client: httpx.AsyncClient) -> Outcome:
        body, kind, turns = sessions.next_body()
        outcome = await request_with_retry(client, url, body, timeout_s, retry)
        outcome.turn = kind
        sessions.answered(body, outcome.retry or outcome, turns)
        return outcome

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
        sampler = asyncio.create_task(sample_memory(client))
        tasks = []
        next_at = 0.0
        while next_at < duration_s:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(turn(client)))
            next_at += rng.expovariate(rate_per_s)
        result.outcomes = list(await asyncio.gather(*tasks))
        stop_sampling.set()
        await sampler
    return result


async def closed_loop_capacity(url: str, clients: int, seconds: float, max_tokens: int,
                               max_seconds: float = 600.0) -> float:
    """Completed requests per second with `clients` back-to-back clients, each running two-turn sessions
    (a cold turn, then its continuation): over at least `seconds`, and until every client has completed
    two requests (a loaded machine's first answers can take longer)."""
    done = [0] * clients
    start = time.perf_counter()

    async def client_loop(c: int, client: httpx.AsyncClient) -> None:
        i = 0
        while True:
            elapsed = time.perf_counter() - start
            if elapsed > max_seconds or (elapsed > seconds and min(done) >= 2):
                return
            body = cold_turn(10_000 * (c + 1) + i, max_tokens)
            for turn in range(2):
                outcome = await one_request(client, url, body, 600)
                while outcome.kind == "rejected" and outcome.retry_after is not None:  # the server's first steps
                    await asyncio.sleep(float(outcome.retry_after))
                    outcome = await one_request(client, url, body, 600)
                if outcome.kind != "ok":
                    raise RuntimeError(f"capacity probe: a request failed ({outcome.kind} {outcome.status}: "
                                       f"{outcome.detail})")
                done[c] += 1
                body = next_turn(body, outcome.text, turn + 2)
            i += 1

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(client_loop(c, client) for c in range(clients)))
    return sum(done) / (time.perf_counter() - start)


def _percentiles(values: list[float], prefix: str) -> dict:
    if not values:
        return {f"{prefix}_n": 0}
    p50, p99 = np.percentile(values, [50, 99])
    return {f"{prefix}_n": len(values), f"{prefix}_p50_s": round(float(p50), 3),
            f"{prefix}_p99_s": round(float(p99), 3)}


def _drift(samples: list[tuple[float, int]], settle_s: float, name: str) -> dict:
    """The level after settle_s seconds and the most it moved from there, in MiB and percent."""
    later = [b for t, b in samples if t >= settle_s]
    if not later:
        return {}
    base = later[0]
    return {f"{name}_at_{settle_s:g}s_mib": round(base / 2**20, 1), f"{name}_max_mib": round(max(later) / 2**20, 1),
            f"{name}_end_mib": round(later[-1] / 2**20, 1),
            f"{name}_max_drift_pct": round(100 * (max(later) - base) / max(base, 1), 1)}


ADMISSION_GAUGES = ("calibration", "show_rate", "promises_kept", "promises_expired", "prefill_seconds_per_token",
                    "decode_step_seconds", "turn_seconds")


def admission_state(url: str) -> dict:
    """The server's admission gauges from /metrics (sudu:admission_*), as they stand after a load."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = {}
    for line in text.splitlines():
        for name in ADMISSION_GAUGES:
            if line.startswith(f"sudu:admission_{name} "):
                found[name] = round(float(line.split()[1]), 4)
    return found


def refused_queue_s(detail: str) -> float | None:
    """The predicted queue seconds a 429's message gives (sudu's admission), or None."""
    match = re.search(r"wait behind other requests is ([0-9.]+) s", detail)
    return float(match.group(1)) if match else None


def summarize(result: RunResult, offered_per_s: float, capacity_per_s: float, max_queue_wait_s: float = 0.0,
              settle_s: float = 10.0) -> dict:
    tries = result.outcomes + [o.retry for o in result.outcomes if o.retry is not None]
    admitted = [o for o in tries if o.kind == "ok"]
    ttfts = [o.ttft_s for o in admitted if o.ttft_s is not None]
    rejected = [o for o in result.outcomes if o.kind == "rejected"]
    retried = [o.retry for o in rejected if o.retry is not None]
    summary = {
        "capacity_req_per_s": round(capacity_per_s, 3), "offered_req_per_s": round(offered_per_s, 3),
        "requests": len(result.outcomes), "ok_first_try": result.count("ok"), "rejected_429": len(rejected),
        "rejected_with_retry_after": sum(o.retry_after is not None for o in rejected),
        "retries": len(retried), "retries_admitted": sum(o.kind == "ok" for o in retried),
        "ok_total": len(admitted),
        "errors": sum(o.kind == "error" for o in tries), "lost": sum(o.kind == "lost" for o in tries),
    }
    if retried:
        summary["retry_admitted_share"] = round(summary["retries_admitted"] / len(retried), 3)
        # why returning clients were refused again: the server's predicted queue at their return (its 429
        # message gives it) against the limit a returning request is held to; near misses and far misses
        # call for different fixes
        again = [q for q in (refused_queue_s(o.detail) for o in retried if o.kind == "rejected") if q is not None]
        if again:
            summary.update(_percentiles(again, "retry_refused_queue"), retry_refused_queue_min_s=min(again))
    if ttfts:
        p50, p90, p99 = np.percentile(ttfts, [50, 90, 99])
        summary.update(ttft_p50_s=round(float(p50), 3), ttft_p90_s=round(float(p90), 3),
                       ttft_p99_s=round(float(p99), 3), ttft_max_s=round(max(ttfts), 3))
        if max_queue_wait_s:
            summary["ttft_p99_over_max_queue_wait"] = round(float(p99) / max_queue_wait_s, 2)
    for kind in ("continuing", "cold"):
        of_kind = [o for o in result.outcomes if o.turn == kind]
        done = [t for o in of_kind for t in ([o] + ([o.retry] if o.retry else [])) if t.kind == "ok"]
        summary.update(_percentiles([o.ttft_s for o in done if o.ttft_s is not None], f"ttft_{kind}"))
        cached = [o.cached_tokens for o in done if o.cached_tokens is not None]
        if cached:
            summary[f"cached_tokens_{kind}_mean"] = round(float(np.mean(cached)), 1)
    if result.rss_bytes:
        summary.update(_drift(result.rss_bytes, settle_s, "rss"))
    if result.kv_resident_bytes:
        summary.update(_drift(result.kv_resident_bytes, settle_s, "kv_resident"))
    details = sorted({o.detail for o in tries if o.kind in ("error", "lost")})
    if details:
        summary["error_details"] = details[:5]
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--loads", default="1.5,2,4", help="offered rates as multiples of the measured capacity")
    ap.add_argument("--duration-s", type=float, default=60.0, help="seconds of arrivals per load")
    ap.add_argument("--probe-s", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-queue-wait", type=float, default=5.0, help="the server's --max-queue-wait")
    ap.add_argument("--continuing-share", type=float, default=0.5,
                    help="arrivals that continue an answered session (the rest start one)")
    ap.add_argument("--no-retry", action="store_true", help="do not resend a refused request after its Retry-After")
    ap.add_argument("--serve-args", default="", help="more `sudu serve` flags")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = f"--max-num-seqs {args.max_num_seqs} --max-queue-wait {args.max_queue_wait} --log-level warning " \
            + args.serve_args
    log_path = os.path.join(tempfile.gettempdir(), f"sudu-overload-{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve_command(port, args.model, extra), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    report = {"command": " ".join(serve_command(port, args.model, extra)), "loads": {}}
    try:
        wait_for_health(proc, url, 900, log_path)
        # the server's first requests build and page in what later ones reuse (the native kernels compile
        # at first use where their build is not cached): a probe that timed them would understate capacity
        print("warm-up: one closed-loop client for 10 s ...", flush=True)
        asyncio.run(closed_loop_capacity(url, 1, 10.0, args.max_tokens))
        capacity = asyncio.run(closed_loop_capacity(url, args.max_num_seqs, args.probe_s, args.max_tokens))
        print(f"capacity: {capacity:.3f} requests/s", flush=True)
        for i, load in enumerate(float(x) for x in args.loads.split(",")):
            offered = load * capacity
            result = asyncio.run(open_loop(url, offered, args.duration_s, args.max_tokens, seed=i, server_pid=proc.pid,
                                           continuing_share=args.continuing_share, retry=not args.no_retry))
            summary = summarize(result, offered, capacity, args.max_queue_wait)
            summary["server_admission"] = admission_state(url)
            report["loads"][f"{load:g}x"] = summary
            print(f"{load:g}x: {json.dumps(summary)}", flush=True)
        report["server_alive"] = proc.poll() is None
    finally:
        stop_server(proc)
    print(json.dumps(report, indent=2))
    bad = sum(s["lost"] + s["errors"] for s in report["loads"].values())
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
