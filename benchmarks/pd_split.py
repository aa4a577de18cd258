"""Prefill/decode split on one machine: 4 decoding streams while a 4,000-token prompt arrives, against a
unified `sudu serve` (all threads, one engine) and `sudu serve --pd 1:1` (a prefill replica and a decode
replica, one core each, KV blocks handed over through Ray's object store).

For each configuration, over HTTP with streaming: the 4 streams decode alone (ITL baseline), then 4 fresh
streams decode while the long prompt is sent (ITL of the gaps that end while it is in flight, until its
first token). Reported: ITL median / p99 alone and mixed and the p99 ratio (the issue's target: <= 1.5x
with the split), the 4 streams' output tok/s while the long prompt is in flight, the long prompt's TTFT,
and the handoff's bytes and seconds (the `sudu` extension). Every prompt is salted: cold everywhere.

    flock /tmp/sudu-bench.lock python -m benchmarks.pd_split [--model qwen2.5-coder-0.5b-instruct]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from sudu.bench.local_server import free_port, serve_command, stop_server, wait_for_health

WORDS = ("the of and to in is for on that with as by this from at are be or an it not which can all has "
         "function return value error request server cache token model stream batch memory thread").split()


def text(n_words: int, salt: str) -> str:
    g = random.Random(salt)
    return salt + " " + " ".join(g.choice(WORDS) for _ in range(n_words))


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                 stop: asyncio.Event | None = None) -> dict:
    """Chunk arrival times (perf_counter) of one streamed completion, and its final `sudu` extension."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, sudu, usage = [], {}, {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
            sudu = chunk.get("sudu") or sudu
            usage = chunk.get("usage") or usage
            if stop is not None and stop.is_set():
                break
    return {"t0": t0, "times": times, "sudu": sudu, "usage": usage}


def gaps(times: list[float], lo: float = float("-inf"), hi: float = float("inf")) -> list[float]:
    return [b - a for a, b in zip(times, times[1:]) if lo <= b <= hi]


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


async def measure(url: str, model: str, args, tag: str) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, model, text(20, f"warm-{tag}"), 8)  # first-request costs out of the way
        alone = await asyncio.gather(*(stream(client, url, model, text(60, f"alone-{tag}-{i}"), args.alone_tokens)
                                       for i in range(args.streams)))
        stop = asyncio.Event()
        streams = [asyncio.create_task(stream(client, url, model, text(60, f"mixed-{tag}-{i}"), 4000, stop))
                   for i in range(args.streams)]
        await asyncio.sleep(args.lead_s)  # the streams are decoding
        long = await stream(client, url, model, text(args.long_words, f"long-{tag}"), 4)
        long_first = long["times"][0]
        await asyncio.sleep(0.5)
        stop.set()
        mixed = await asyncio.gather(*streams)
    base = [g for s in alone for g in gaps(s["times"][4:])]
    window = [g for s in mixed for g in gaps(s["times"], long["t0"], long_first)]
    tokens_in_window = sum(1 for s in mixed for t in s["times"] if long["t0"] < t <= long_first)
    return {"itl_alone_ms": (1e3 * statistics.median(base), 1e3 * p99(base)),
            "itl_mixed_ms": (1e3 * statistics.median(window), 1e3 * p99(window)),
            "p99_ratio": p99(window) / p99(base), "n_gaps": (len(base), len(window)),
            "window_tok_s": tokens_in_window / (long_first - long["t0"]),
            "long_ttft_s": long_first - long["t0"], "long_prompt_tokens": long["usage"].get("prompt_tokens"),
            "handoff": {k: v for k, v in long["sudu"].items() if k.startswith(("handoff", "prefill_replica"))}}


def run(name: str, serve_args: str, args) -> dict:
    port = free_port()
    log = os.path.join(tempfile.gettempdir(), f"pd-split-{name}-{port}.log")
    cmd = serve_command(port, args.model, f"--disk-cache-size 0 --max-model-len 8192 {serve_args}")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        ready = wait_for_health(proc, f"http://127.0.0.1:{port}", 900, log)
        print(f"{name}: ready after {ready:.0f} s", flush=True)
        return asyncio.run(measure(f"http://127.0.0.1:{port}", args.model, args, name))
    finally:
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--alone-tokens", type=int, default=96)
    p.add_argument("--long-words", type=int, default=4000, help="words of the long prompt (about one token each)")
    p.add_argument("--lead-s", type=float, default=3.0, help="seconds the streams decode before the long prompt")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    configs = {"unified": f"--num-threads {args.threads}",
               "pd 1:1": f"--pd 1:1 --replica-cpus {max(1, args.threads // 2)}"}
    results = {}
    for name, serve_args in configs.items():
        results[name] = run(name.replace(" ", "-").replace(":", "x"), serve_args, args)
        print(json.dumps({name: results[name]}), flush=True)
    print(f"\n{args.streams} streams decoding while a {results['unified']['long_prompt_tokens']}-token prompt "
          f"arrives; {args.threads} cores\n")
    print("| configuration | ITL alone median / p99 ms | ITL mixed median / p99 ms | p99 ratio | streams tok/s "
          "while the prompt runs | long prompt TTFT s | handoff |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, r in results.items():
        h = r["handoff"]
        handoff = f"{h['handoff_bytes'] / 2**20:.1f} MiB, {1e3 * h['handoff_s']:.0f} ms" if h else "-"
        print(f"| {name} | {r['itl_alone_ms'][0]:.0f} / {r['itl_alone_ms'][1]:.0f} | {r['itl_mixed_ms'][0]:.0f} / "
              f"{r['itl_mixed_ms'][1]:.0f} | {r['p99_ratio']:.2f}x | {r['window_tok_s']:.1f} | "
              f"{r['long_ttft_s']:.1f} | {handoff} |")


if __name__ == "__main__":
    sys.exit(main())
