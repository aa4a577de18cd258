"""The client's own cost, measured against the instant fake server in a separate process (so the two
do not share a GIL): TTFT at concurrency 1 (an upper bound on what the client adds: it also holds the
loopback and the fake server's own work) and sustained streaming requests/s at high concurrency."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from contextlib import contextmanager

from sudu.bench.client import ClientPool, RequestRecord, auth_headers, chat_body, stream_chat
from sudu.bench.local_server import free_port, stop_server, wait_for_health
from sudu.bench.stats import summarize

FAKE_SERVER_START_S = 30.0
TTFT_BUDGET_MS = 1.0
RATE_TARGET_REQ_S = 500.0


async def measure(base: str, n_latency: int = 200, n_rate: int = 2000, concurrency: int = 64) -> dict:
    headers = auth_headers(None)
    messages = [{"role": "user", "content": "hi"}]
    async with ClientPool() as pool:

        async def one() -> RequestRecord:
            rec = RequestRecord(0, "overhead", "cold")
            async with pool.acquire() as client:
                return await stream_chat(client, base, chat_body("fake", messages, 16), headers, rec)

        await asyncio.gather(*(one() for _ in range(concurrency)))  # open the pool's connections
        ttft = []
        for _ in range(n_latency):
            rec = await one()
            if rec.ok:
                ttft.append(rec.chunk_times_s[0] * 1e3)
        sem = asyncio.Semaphore(concurrency)
        ok = [0]

        async def limited() -> None:
            async with sem:
                if (await one()).ok:
                    ok[0] += 1

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(limited() for _ in range(n_rate)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    s = summarize(ttft)
    rate = ok[0] / wall
    return {
        "ttft_ms": s.to_dict(),
        "requests_per_s": rate,
        # CPU the client process spent per request: on a busy machine a steadier figure than requests/s;
        # 1000 / cpu_ms_per_request is what one free core would sustain
        "cpu_ms_per_request": 1e3 * cpu / n_rate,
        "concurrency": concurrency,
        "requests": n_rate,
        "failed": n_rate - ok[0],
        "ttft_budget_ms": TTFT_BUDGET_MS,
        "rate_target_req_s": RATE_TARGET_REQ_S,
        "meets_targets": bool(s.median is not None and s.median <= TTFT_BUDGET_MS and rate >= RATE_TARGET_REQ_S),
        "note": "TTFT against a server that answers at once: client + loopback + fake server, an upper bound "
        "on the client's own share",
    }


@contextmanager
def instant_fake_server():
    """The instant fake server in its own process (no shared GIL with the client); yields its /v1 URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sudu.bench.fake_server", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}", FAKE_SERVER_START_S, name="the fake server")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_server(proc)


def run_overhead(n_latency: int = 200, n_rate: int = 2000, concurrency: int = 64) -> dict:
    with instant_fake_server() as base:
        return asyncio.run(measure(base, n_latency, n_rate, concurrency))
