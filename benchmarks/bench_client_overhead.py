"""How much sudu bench's client costs: TTFT against a local fake server that answers at once (an upper
bound on the client's share: it includes loopback and the fake server) and sustained streaming
requests/s at concurrency 64, with the fake server in its own process. Targets: <= 1 ms TTFT, >= 500
req/s on a 2-core machine. Also runs the same load through one shared httpx pool (the baseline the
per-request pool replaced) so the ratio is printed side by side.

    python benchmarks/bench_client_overhead.py [--requests 3000] [--concurrency 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from sudu.bench.client import RequestRecord, auth_headers, chat_body, make_client, stream_chat
from sudu.bench.overhead import RATE_TARGET_REQ_S, TTFT_BUDGET_MS, instant_fake_server, measure


async def shared_pool_rate(base: str, n: int, concurrency: int) -> float:
    """Baseline: one httpx.AsyncClient whose pool holds all `concurrency` connections."""
    headers = auth_headers(None)
    body = chat_body("fake", [{"role": "user", "content": "hi"}], 16)
    async with make_client(max_connections=concurrency) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                await stream_chat(client, base, body, headers, RequestRecord(0, "baseline", "cold"))

        await asyncio.gather(*(one() for _ in range(concurrency)))
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rates, ttfts, cpus, baseline = [], [], [], []
    with instant_fake_server() as base:
        for _ in range(args.rounds):
            res = asyncio.run(measure(base, 300, args.requests, args.concurrency))
            rates.append(res["requests_per_s"])
            ttfts.append(res["ttft_ms"]["median"])
            cpus.append(res["cpu_ms_per_request"])
            baseline.append(asyncio.run(shared_pool_rate(base, min(args.requests, 1000), args.concurrency)))
    rate, ttft, base_rate = statistics.median(rates), statistics.median(ttfts), statistics.median(baseline)
    cpu = statistics.median(cpus)
    print(f"client self-test, {args.rounds} rounds (medians), concurrency {args.concurrency}:")
    print(f"  streaming requests/s : {rate:.0f}  (target >= {RATE_TARGET_REQ_S:.0f}; rounds {[round(r) for r in rates]})")
    print(f"  client CPU / request : {cpu:.3f} ms  (one free core: {1e3 / cpu:.0f} req/s)")
    print(f"  TTFT, instant server : {ttft:.3f} ms  (budget <= {TTFT_BUDGET_MS} ms; rounds {[round(t, 3) for t in ttfts]})")
    print(f"  one shared httpx pool: {base_rate:.0f} req/s -> per-request pools are {rate / base_rate:.1f}x faster")
    ok = rate >= RATE_TARGET_REQ_S and ttft <= TTFT_BUDGET_MS
    print("  meets targets" if ok else "  MISSES targets")


if __name__ == "__main__":
    main()
