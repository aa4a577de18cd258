"""This checkout's `sudu serve` against another checkout's (a base commit), both up at once on the same model
and threads, measured alternately so that the VM's drift over minutes reaches both alike: is a change
speed-neutral?

- decode: the independent client's single-stream decode speed, prompt by prompt, alternating which server
  goes first (vs_llama_server.py `interleaved`);
- prompt: cold prompts' time to first token, the same way (vs_llama_server.py `prompt_pairs`);
- 32 streams: `sudu bench throughput --concurrency 32` on each server in turn, `--rounds` times, the order
  reversed every round; the median of the per-round ratios.

Each server runs from its own tree (PYTHONPATH) with its own $SUDU_HOME (its native kernels built from its
own sources), models shared. Prints each part's ratio this / base with its spread. This side runs with
admission by predicted wait off (`--max-queue-wait 0`), so both serve every stream; a run in which any stream
fails stops with the error instead of a speed.

    git worktree add /tmp/base 64f48cc
    python benchmarks/vs_commit.py --base /tmp/base --base-home /tmp/home-base [--model M] [--threads 2]
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(HERE, "benchmarks"), HERE]

import vs_llama_server as V  # noqa: E402

from sudu.bench import compare  # noqa: E402
from sudu.bench.local_server import free_port, stop_server, wait_for_health  # noqa: E402


def server(tree: str, home: str | None, model: str, threads: int, streams: int, extra: str = ""):
    """A `sudu serve` command factory for one tree (with `extra` flags), and the environment it runs in."""
    env = dict(os.environ, PYTHONPATH=tree)
    if home:
        env["SUDU_HOME"] = home
    cmd = lambda port: [sys.executable, "-m", "sudu.cli", "serve", "--model", model, "--port", str(port),  # noqa: E731
                        "--num-threads", str(threads), "--max-num-seqs", str(streams), "--disk-cache-size", "0",
                        *shlex.split(extra)]
    return cmd, env


def start(name: str, cmd, env: dict, log_dir: str):
    port = free_port()
    log = os.path.join(log_dir, f"{name}-{port}.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd(port), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, cwd=env["PYTHONPATH"])
    wait_for_health(proc, f"http://127.0.0.1:{port}", 900, log)
    print(f"{name} ready ({log})", flush=True)
    return proc, f"http://127.0.0.1:{port}/v1"


def throughput(url: str, model: str, out: str, max_tokens: int, streams: int) -> float:
    """Output tok/s of one `sudu bench throughput` run at `streams` concurrent streams."""
    subprocess.run([sys.executable, "-m", "sudu.cli", "bench", "throughput", "--concurrency", str(streams), "-n",
                    str(streams), "--output-len", str(max_tokens), "--input-words", "128", "--ignore-eos", "--no-html",
                    "--no-progress", "--warmup", "2", "--url", url, "--model", model, "--out", out],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=HERE)
    group = compare.load(sorted(glob.glob(os.path.join(out, "*.json")))[-1])["groups"][0]
    if group["n_ok"] != group["n_requests"]:  # a speed over the answered part of the load would flatter neither side
        sys.exit(f"vs_commit: {group['n_requests'] - group['n_ok']} of {group['n_requests']} streams failed at {url} "
                 f"(first: {(group['errors'] or ['?'])[0][:200]}); see {out}")
    return group["throughput"]["mean_tok_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the other checkout's root")
    p.add_argument("--base-home", default=None, help="$SUDU_HOME for the base (its own kernel build)")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--n-interleaved", type=int, default=12)
    p.add_argument("--n-prompt-pairs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="32-stream runs per server")
    p.add_argument("--out", default=None)
    p.add_argument("--this-args", default="", help="more `sudu serve` flags for this checkout's server, e.g. "
                   "--fast-math true to compare a layout change against a base without exact-by-default kernels")
    args = p.parse_args()
    if not os.path.isdir(os.path.join(args.base, "sudu")):
        sys.exit(f"vs_commit: {args.base} is not a sudu checkout")
    out = args.out or tempfile.mkdtemp(prefix="vs-commit-")
    os.makedirs(out, exist_ok=True)
    # admission by predicted wait off on this side: the base may have none, and 32 streams sent at once are over
    # the default --max-queue-wait, so some would be refused and the two sides would not serve the same load
    sides = {"sudu": server(HERE, None, args.model, args.threads, 32, "--max-queue-wait 0 " + args.this_args),
             "base": server(os.path.abspath(args.base), args.base_home, args.model, args.threads, 32)}
    procs, urls = [], {}
    try:
        for name, (cmd, env) in sides.items():
            proc, url = start(name, cmd, env, out)
            procs.append(proc)
            urls[name] = url
        print("decode, 1 stream, alternating: this / base", V.interleaved(urls, args.model, args.n_interleaved,
                                                                          args.max_tokens, 1.0), flush=True)
        print("cold prompts, alternating: this / base", V.prompt_pairs(urls, args.model, args.n_prompt_pairs, 400, 1.0),
              flush=True)
        speeds = {name: [] for name in urls}
        for r in range(args.rounds):
            for name in (list(urls) if r % 2 == 0 else list(reversed(urls))):
                speeds[name].append(throughput(urls[name], args.model, os.path.join(out, f"{name}-c32-{r}"),
                                               args.max_tokens, 32))
                print(f"  32 streams, round {r + 1}, {name}: {speeds[name][-1]:.1f} tok/s", flush=True)
        if not args.rounds:
            return
        ratios = [a / b for a, b in zip(speeds["sudu"], speeds["base"])]
        print(f"32 streams: this {statistics.median(speeds['sudu']):.1f} tok/s, base "
              f"{statistics.median(speeds['base']):.1f} tok/s; per-round ratio median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    finally:
        for proc in procs:
            stop_server(proc)


if __name__ == "__main__":
    main()
