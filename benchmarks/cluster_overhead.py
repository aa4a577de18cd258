"""What Ray Serve adds: `sudu bench single` (one stream at a time, cold prompts) against a plain `sudu serve`
and against `sudu serve --replicas 1` with the same threads, then `sudu bench compare` on the two reports
(TTFT and decode speed, each with its ratio's 95% CI). The difference is the ingress -> DeploymentHandle ->
replica hop and the router.

    flock /tmp/sudu-bench.lock python -m benchmarks.cluster_overhead -n 20 [--serve-args "--stream-interval 4"]

--serve-args go to both servers (the same engine flags on each side).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile


def run_single(out_dir: str, serve_args: str, args) -> str:
    cmd = [sys.executable, "-m", "sudu.cli", "bench", "single", "-n", str(args.num_requests), "--max-tokens",
           str(args.max_tokens), "--out", out_dir, "--no-progress", "--no-html", "--server-timeout", "600",
           "--serve-args", f"--disk-cache-size 0 --num-threads {args.threads} {args.serve_args} {serve_args}"]
    subprocess.run(cmd, check=True, timeout=args.timeout)
    return sorted(glob.glob(os.path.join(out_dir, "single-*.json")))[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--num-requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--serve-args", default="", help="engine flags for both servers, e.g. '--stream-interval 4'")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain = run_single(os.path.join(tmp, "plain"), "", args)
        ray = run_single(os.path.join(tmp, "ray"), f"--replicas 1 --replica-cpus {args.threads}", args)
        both = f" (both with {args.serve_args.strip()})" if args.serve_args.strip() else ""
        print(f"\nA = plain sudu serve, B = sudu serve --replicas 1 (Ray Serve){both}\n", flush=True)
        subprocess.run([sys.executable, "-m", "sudu.cli", "bench", "compare", plain, ray], check=True)
        print("\nwhere the time went (means, ms): outside the engine = request time - the engine's queue, prefill "
              "and decode (the server's own timing)")
        for name, path in (("plain", plain), ("ray", ray)):
            with open(path) as f:
                groups = json.load(f)["groups"]
            for g in groups:
                a = g.get("attribution") or {}
                cells = ", ".join(f"{k.removesuffix('_s')} {1e3 * a[k]['mean']:.1f}" for k in
                                  ("network_client_s", "queue_s", "prefill_s", "decode_s") if k in a)
                print(f"  {name} {g['name']}: {cells}")


if __name__ == "__main__":
    main()
