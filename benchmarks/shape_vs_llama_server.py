"""sudu serve against llama.cpp's llama-server on one GGUF (the "7B shape" figures of docs/benchmarks.md, a
file from benchmarks/synthetic_gguf.py): resident memory after load, and prompt and decode speed at
context depths measured by `sudu bench sweep` with both endpoints in one run (requests alternate between
them, never concurrent; every prompt cold and salted), next to each depth's decode limit:
bandwidth / (bytes of weights read per token + bytes of float16 KV per token at that depth).

Both servers get the same threads and context: llama-server `-t T -tb T -np 1 -c CTX`; sudu
`--num-threads T --max-model-len CTX --kv-cache-dtype float16` with a KV pool of CTX tokens (llama-server's
KV is float16 too), `--speculative none` (n-gram drafts would copy a random model's repeats) and
`--disk-cache-size 0`.

    flock /tmp/sudu-bench.lock nice -n -5 python benchmarks/shape_vs_llama_server.py \\
        --gguf /work/big7b-data/qwen2.5-7b-shape-q4_k_m.gguf [--depths 512,2k,4k] [--repeats 2]

The weights' bytes per token are the file's tensors except the token embedding, plus one embedding row:
what a decode step at batch 1 must read whichever server runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import gguf
import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llama_server
from vs_llama_server import start

from sudu.bench.local_server import free_port, stop_server
from sudu.commands.roofline import measure_bandwidth_gbs


def bytes_per_token(path: str) -> tuple[int, int]:
    """(weight bytes a batch-1 decode step reads, float16 KV bytes per token of context) of a GGUF."""
    r = gguf.GGUFReader(path)
    weights = 0
    for t in r.tensors:
        if t.name == "token_embd.weight":
            weights += int(t.n_bytes) // int(t.shape[-1])  # one row: shape is (columns, rows) in ggml's order
        else:
            weights += int(t.n_bytes)
    arch = r.fields["general.architecture"].contents()
    hidden, heads, kv_heads, layers = (r.fields[f"{arch}.{key}"].contents() for key in (
        "embedding_length", "attention.head_count", "attention.head_count_kv", "block_count"))
    kv = 2 * layers * kv_heads * (hidden // heads) * 2
    return weights, kv


def memory_mib(pid: int) -> dict[str, float]:
    """A process's resident set from /proc, in MiB: the whole (VmRSS), its anonymous part (RssAnon: heap,
    repacked weights, KV), its file pages (RssFile: a memory-mapped GGUF's touched pages, which the kernel
    may drop and read again) and the peak resident set so far (VmHWM, file pages included)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def warm(url: str) -> None:
    """One short request: the first forward pass touches what loading left untouched (mmap'd pages)."""
    httpx.post(f"{url}/v1/chat/completions", timeout=600,
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).raise_for_status()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--depths", default="512,2k,4k")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--llama-dir", default=llama_server.DEFAULT_DIR)
    ap.add_argument("--out", default="bench-results/shape-vs-llama-server")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    weights_b, kv_b = bytes_per_token(args.gguf)
    t = str(args.threads)
    ports = {"sudu": free_port(), "llama-server": free_port()}
    commands = {
        "sudu": [sys.executable, "-m", "sudu.cli", "serve", "--model", args.gguf, "--port", str(ports["sudu"]),
                 "--num-threads", t, "--max-model-len", str(args.ctx), "--kv-cache-dtype", "float16",
                 "--kv-cache-memory", str(args.ctx * kv_b), "--speculative", "none", "--disk-cache-size", "0",
                 "--log-level", "warning"],
        "llama-server": [llama_server.require(args.llama_dir), "-m", args.gguf, "--port", str(ports["llama-server"]),
                         "-t", t, "-tb", t, "-np", "1", "-c", str(args.ctx)],
    }
    procs, memory = {}, {}
    try:
        for name, cmd in commands.items():
            t0 = time.perf_counter()
            procs[name] = start(name, cmd, ports[name], args.out)
            load_s = time.perf_counter() - t0
            loaded = memory_mib(procs[name].pid)
            warm(f"http://127.0.0.1:{ports[name]}")
            memory[name] = {"load_s": load_s, "after_load": loaded, "after_first_request": memory_mib(procs[name].pid)}
            print(f"{name}: {memory[name]}", flush=True)
        sweep = [sys.executable, "-m", "sudu.cli", "bench", "sweep", "--depths", args.depths, "--modes", "cold",
                 "--repeats", str(args.repeats), "--decode-tokens", str(args.decode_tokens), "--out", args.out]
        for name, port in ports.items():
            sweep += ["--url", f"http://127.0.0.1:{port}", "--label", name]
        subprocess.run(sweep, check=True)
        for name, proc in procs.items():
            memory[name]["after_sweep"] = memory_mib(proc.pid)
        bandwidth = measure_bandwidth_gbs(threads=args.threads)
    finally:
        for proc in procs.values():
            stop_server(proc)
    report_path = max((os.path.join(args.out, f) for f in os.listdir(args.out) if f.startswith("sweep-")
                       and f.endswith(".json")), key=os.path.getmtime)
    with open(report_path) as f:
        points = json.load(f)["points"]
    fig = {(p["endpoint"], p["depth"]): p["figures"] for p in points}
    print(f"\nbandwidth {bandwidth:.1f} GB/s (2 threads, timed sums); weights {weights_b / 1e9:.3f} GB/token, "
          f"float16 KV {kv_b / 1e3:.1f} kB per token of context; sweep report {report_path}")
    print("| MiB | sudu | llama-server | sudu / llama-server |\n|---|---:|---:|---:|")
    s, p = memory["sudu"], memory["llama-server"]
    for when in ("after_load", "after_first_request", "after_sweep"):
        for key in ("VmRSS", "RssAnon", "RssFile") + (("VmHWM",) if when == "after_sweep" else ()):
            print(f"| {key} {when.replace('_', ' ')} | {s[when][key]:.0f} | {p[when][key]:.0f} | "
                  f"{s[when][key] / p[when][key]:.2f}x |")
    print("\n| depth | prompt tok/s sudu | llama | ratio | decode tok/s sudu | llama | ratio | limit tok/s "
          "| sudu of limit | llama of limit |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for depth in sorted({d for _, d in fig}):
        a, b = fig.get(("sudu", depth)), fig.get(("llama-server", depth))
        if not a or not b:
            continue
        pa, pb = a["prompt_tok_s"]["mean"], b["prompt_tok_s"]["mean"]
        da, db = a["decode_tok_s"]["mean"], b["decode_tok_s"]["mean"]
        limit = bandwidth * 1e9 / (weights_b + kv_b * depth)
        print(f"| {depth} | {pa:.1f} | {pb:.1f} | {pa / pb:.2f}x | {da:.2f} | {db:.2f} | {da / db:.2f}x | "
              f"{limit:.2f} | {da / limit:.0%} | {db / limit:.0%} |")
    with open(os.path.join(args.out, "shape-summary.json"), "w") as f:
        json.dump({"memory": memory, "bandwidth_gbs": bandwidth, "weights_bytes_per_token": weights_b,
                   "kv_bytes_per_context_token": kv_b, "sweep_report": report_path}, f, indent=1)


if __name__ == "__main__":
    main()
