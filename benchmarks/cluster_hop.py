"""The Ray hop alone: a tiny random model whose engine work is about a millisecond, served plainly and with
`--replicas 1` (one core per side), and timed per request from a client: sequential non-streaming
requests of one token (the hop's fixed cost) and streamed requests of 32 tokens (its cost per token).
Each Ray configuration is a set of Ray Serve environment variables, passed to the server (and so to the
local Ray instance it starts).

    flock /tmp/sudu-bench.lock python -m benchmarks.cluster_hop [-n 40] [--configs plain,ray,ray-classic] [--rounds 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sudu.bench.local_server import free_port, serve_command, stop_server, wait_for_health

# name -> (sudu serve arguments, environment)
CONFIGS = {
    "plain": ("", {}),
    "ray": ("--replicas 1 --replica-cpus 1", {}),  # sudu's default: Serve's throughput mode (cluster/serve.py)
    # Serve's classic transport: Ray actor tasks, user code and routers on threads of their own
    "ray-classic": ("--replicas 1 --replica-cpus 1", {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}),
}


def timed(client: httpx.Client, url: str, body: dict, stream: bool) -> tuple[float, int]:
    """(seconds, tokens) of one request."""
    t0 = time.perf_counter()
    if not stream:
        r = client.post(url, json=body)
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]
    chunks = 0
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
    return time.perf_counter() - t0, chunks


def measure(model: str, name: str, n: int) -> dict:
    serve_args, env = CONFIGS[name]
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"hop-{name}-", suffix=".log", delete=False)
    cmd = serve_command(port, model, f"--num-threads 1 --disk-cache-size 0 {serve_args}")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **env})
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}", 600, log.name, name=f"sudu serve ({name})")
        url = f"http://127.0.0.1:{port}/v1/completions"
        one = {"prompt": "hello there", "max_tokens": 1, "temperature": 0}
        many = {"prompt": "hello there", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=60) as client:
            for _ in range(5):  # warm-up
                timed(client, url, one, False)
            fixed = [timed(client, url, {**one, "prompt": f"hello there {i}"}, False)[0] for i in range(n)]
            per_token = []
            for i in range(max(4, n // 4)):
                s, tokens = timed(client, url, {**many, "prompt": f"count {i}"}, True)
                per_token.append(s / max(1, tokens))
        return {"request_ms": statistics.median(fixed) * 1e3, "token_ms": statistics.median(per_token) * 1e3}
    finally:
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=40, help="one-token requests per configuration")
    p.add_argument("--configs", default="plain,ray,ray-classic")
    p.add_argument("--rounds", type=int, default=1, help="repeat the configurations in turn")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.helpers.tiny_models import save_tiny_model

    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"cluster_hop: error: unknown configuration {unknown[0]!r} (known: {', '.join(CONFIGS)})")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(save_tiny_model(Path(tmp) / "tiny", "qwen2"))
        results: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names:
                res = measure(model, name, args.n)
                results[name].append(res)
                print(f"round {r + 1} {name}: {res['request_ms']:.1f} ms per one-token request, "
                      f"{res['token_ms']:.2f} ms per streamed token", flush=True)
        print("\nconfiguration | ms per one-token request (median; rounds) | ms per streamed token")
        for name in names:
            req = [x["request_ms"] for x in results[name]]
            tok = [x["token_ms"] for x in results[name]]
            print(f"{name} | {statistics.median(req):.1f} ({', '.join(f'{v:.1f}' for v in req)}) | "
                  f"{statistics.median(tok):.2f} ({', '.join(f'{v:.2f}' for v in tok)})")


if __name__ == "__main__":
    main()
