"""Cache-aware routing across replicas: the `sudu bench conversation` suite against one `sudu serve`, then
against `sudu serve --replicas R` with cache-aware routing and with round-robin. Prints the token hit rate
of turns >= 2 (the turns a prefix cache can serve) for each, and how far each is from one server.

The disk tier is off everywhere (`--disk-cache-size 0`): replicas on one machine would share the disk
directory and find each other's blocks there, which is not what replicas on separate machines get.

    flock /tmp/sudu-bench.lock python -m benchmarks.cluster_routing --users 4 --turns 4
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile


def run_suite(out_dir: str, serve_args: str, args) -> dict:
    cmd = [sys.executable, "-m", "sudu.cli", "bench", "conversation", "--users", str(args.users),
           "--turns", str(args.turns), "--team-size", str(args.team_size), "--answer-tokens", str(args.answer_tokens),
           "--tool-output-words", str(args.tool_output_words), "--seed", str(args.seed), "--out", out_dir,
           "--no-progress", "--no-html", "--server-timeout", "600",
           "--serve-args", f"--disk-cache-size 0 --max-model-len {args.max_model_len} {serve_args}"]
    if args.model:
        cmd += ["--model", args.model]
    subprocess.run(cmd, check=True, timeout=args.timeout)
    path = sorted(glob.glob(os.path.join(out_dir, "conversation-*.json")))[-1]
    with open(path) as f:
        return json.load(f)["conversation"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model for sudu serve (default: its default)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--team-size", type=int, default=2)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--tool-output-words", type=int, default=120)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per configuration")
    args = p.parse_args()
    cpus = max(1, (os.cpu_count() or 1) // args.replicas)
    configs = [
        ("1 server", ""),
        (f"{args.replicas} replicas, cache-aware", f"--replicas {args.replicas} --replica-cpus {cpus} --routing cache_aware"),
        (f"{args.replicas} replicas, round-robin", f"--replicas {args.replicas} --replica-cpus {cpus} --routing round_robin"),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, serve_args) in enumerate(configs):
            summary = run_suite(os.path.join(tmp, str(i)), serve_args, args)
            rows.append((name, summary))
    base = rows[0][1]["token_hit_rate_turns_2plus"] or 0.0
    print(f"\nconversation suite: {args.users} users x {args.turns} turns, team size {args.team_size}, "
          f"{args.answer_tokens} answer tokens, {args.tool_output_words} tool-output words\n")
    print("| configuration | token hit rate, turns >= 2 | vs 1 server (points) | all turns | mean TTFT turns >= 2 ms | sessions |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in rows:
        rate = s["token_hit_rate_turns_2plus"] or 0.0
        ttft = s["ttft_mean_turns_2plus_s"]
        print(f"| {name} | {100 * rate:.1f}% | {100 * (rate - base):+.1f} | {100 * (s['token_hit_rate_all'] or 0):.1f}% | "
              f"{'n/a' if ttft is None else f'{1000 * ttft:.0f}'} | {s['sessions_completed']}/{s['sessions']} |")


if __name__ == "__main__":
    main()
