"""Ray Serve's own floor on this machine: a no-op deployment (one CPU) called through a DeploymentHandle
from the driver's event loop, unary and streaming (1 and 32 items), median of 40 calls each. What the
sudu replica path costs beyond this is sudu's; this much is Serve's. Run it once with Serve's defaults
and once with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (what `sudu serve --replicas` sets):

    flock /tmp/sudu-bench.lock python -m benchmarks.ray_serve_floor
    RAY_SERVE_THROUGHPUT_OPTIMIZED=1 flock /tmp/sudu-bench.lock python -m benchmarks.ray_serve_floor
"""
from __future__ import annotations

import asyncio
import os
import statistics
import time

import ray
from ray import serve


@serve.deployment(ray_actor_options={"num_cpus": 1})
class Noop:
    async def one(self, x):
        return x

    async def stream(self, n):
        for i in range(n):
            yield i


async def measure(calls: int = 40) -> dict[str, float]:
    handle = serve.get_deployment_handle("Noop", app_name="noop")

    async def unary():
        await handle.one.remote(1)

    async def stream(n):
        async for _ in handle.options(stream=True).stream.remote(n):
            pass

    out = {}
    for name, call in (("unary", unary), ("stream, 1 item", lambda: stream(1)), ("stream, 32 items", lambda: stream(32))):
        for _ in range(5):
            await call()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await call()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        serve.run(Noop.bind(), name="noop", route_prefix=None)
        mode = os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")
        for name, ms in asyncio.run(measure()).items():
            print(f"RAY_SERVE_THROUGHPUT_OPTIMIZED={mode}: no-op {name}: {ms:.2f} ms (median of 40)")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
