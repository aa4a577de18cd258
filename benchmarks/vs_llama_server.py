"""sudu serve vs llama.cpp's own llama-server, both measured by `sudu bench` over HTTP, one server at a
time on the same GGUF and thread count, every prompt cold (sudu bench's salt), outputs of fixed length
(--ignore-eos): single (one stream, varied chat and coding turns), throughput at 1, 8 and 32 streams,
and the cache suite (cold vs warm vs shared-prefix TTFT). Both servers get the same context capacity (32
slots of 1,024 tokens: llama-server's -c, sudu's --kv-cache-memory for as many tokens in its KV dtype), and
each one's resident set is read from /proc after loading and after all the runs. Prints a table of sudu / llama-server ratios
with their bootstrap 95% CIs (from `sudu bench compare`), and, as a check on the measuring client,
sudu bench's decode speed next to an independent minimal client's (benchmarks/independent_client.py)
on each server. Last, both servers run at once (each idle while the other serves) and the independent
client sends each prompt to both, in alternating order: the single-stream decode ratio from pairs a few
seconds apart, which the VM's drift over minutes does not move. `prompt-pairs` does the same for cold
prompts' TTFT (one-token answers to ~500-token salted prompts), the check on the prompt ratio.

    python benchmarks/llama_server.py --build          # once: llama-server with AVX-512, without AMX
    python benchmarks/vs_llama_server.py [--model qwen2.5-coder-0.5b-instruct] [--threads 2] [--out DIR]
                                         [--parts runs,interleaved,prompt-pairs] [--peer ik_llama.cpp]

--peer ik_llama.cpp runs the same against ik_llama.cpp's llama-server (the fastest CPU fork) with its
run-time repacking, -rtr (build it once with benchmarks/ik_llama.py).

Reports of every run stay in --out (JSON, Markdown) for `sudu bench compare`.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import independent_client  # noqa: E402
import ik_llama  # noqa: E402
import llama_server  # noqa: E402

from sudu.bench import compare  # noqa: E402
from sudu.bench.local_server import free_port, stop_server, wait_for_health  # noqa: E402
from sudu.errors import SuduError  # noqa: E402
from sudu.bench.workloads import CHAT_CODE_PROMPTS  # noqa: E402

MODEL = "qwen2.5-coder-0.5b-instruct"
SLOTS = 32


def runs(args) -> list[tuple[str, list[str]]]:
    """(name, sudu bench arguments) of every measured run."""
    common = ["--ignore-eos", "--no-html", "--no-progress", "--warmup", "2"]
    out = [("single", ["single", "-n", str(args.n_single), "--max-tokens", str(args.max_tokens)] + common)]
    for streams, n in ((1, args.n_single), (8, 2 * 8), (32, 32)):
        out.append((f"throughput c={streams}", ["throughput", "--concurrency", str(streams), "-n", str(n),
                                                "--output-len", str(args.max_tokens), "--input-words", "128"] + common))
    out.append(("cache", ["cache", "--lengths", "512", "-n", "10", "--max-tokens", "8", "--no-html", "--no-progress"]))
    return out


def start(name: str, cmd: list[str], port: int, log_dir: str) -> subprocess.Popen:
    log = os.path.join(log_dir, f"{name}-{port}.log")
    with open(log, "w") as f:
        # the peers run in the log folder: ik_llama.cpp's server writes a llama.log where it runs
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=None if name == "sudu" else log_dir)
    ready = wait_for_health(proc, f"http://127.0.0.1:{port}", 900, log)
    print(f"{name} ready after {ready:.1f} s", flush=True)
    return proc


def measure(side: str, url: str, model: str, args) -> dict:
    reports = {}
    for name, bench_args in runs(args):
        out = os.path.join(args.out, side, name.replace(" ", "-").replace("=", ""))
        subprocess.run([sys.executable, "-m", "sudu.cli", "bench", *bench_args, "--url", url, "--model", model,
                        "--out", out], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        reports[name] = compare.load(sorted(glob.glob(os.path.join(out, "*.json")))[-1])
        print(f"  {side}: {name} done", flush=True)
        if name == "single":  # the independent client right after, so both see the machine in the same state
            prompts = [CHAT_CODE_PROMPTS[i % len(CHAT_CODE_PROMPTS)] for i in range(args.n_single)]
            reports["independent"] = independent_client.decode_speeds(url, model, prompts, args.max_tokens)
    return reports


def rss_mb(pid: int) -> tuple[float, float]:
    """(resident set, its peak so far) of a process, in MiB, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def kv_memory_for(model: str, tokens: int, kv_cache_dtype: str) -> tuple[int, str]:
    """(bytes of sudu's KV pool holding `tokens` tokens, its format): the format `kv_cache_dtype` resolves to
    (auto: what the engine's load-time check picks, engine/kv_choice.py), found by loading the engine here
    once; the server is then given that format explicitly."""
    from sudu.engine.llm import LLM

    llm = LLM(model, progress=False, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=64 << 20)
    result = tokens * llm.engine.runner.kv_bytes_per_token(), llm.engine.config.kv_cache_dtype
    llm.close()
    return result


def fmt_ratio(row: dict | None) -> str:
    if row is None or row["ratio"] is None:
        return "-"
    ci = f" [{row['ci_low']:.2f}, {row['ci_high']:.2f}]" if row["ci_low"] is not None else f" ({row['verdict']})"
    return f"{row['ratio']:.2f}x{ci}"


# per run: the figures shown (metric, label, scale)
SHOWN = {
    "single": [("output_speed_tok_s", "per-request output speed tok/s (mean)", 1), ("ttft_s", "TTFT ms (mean)", 1e3)],
    "cache": [("ttft_s", "TTFT ms (mean)", 1e3)],
}
THROUGHPUT = [("throughput_tok_s", "output tok/s (mean of 1-s bins)", 1), ("ttft_s", "TTFT ms (mean)", 1e3)]


def table(sudu: dict, peer: dict, peer_name: str) -> str:
    """The runs' figures side by side. A run whose two reports differ in the work done (sudu bench compare
    refuses them: say a server that did not serve a warm prompt from its cache) is still shown, marked, with
    what differed below the table."""
    lines = [f"| run | figure | sudu serve | {peer_name} | sudu / {peer_name}, 95% CI |", "|---|---|---:|---:|---:|"]
    unlike = []
    for name in (n for n in sudu if n != "independent"):
        shown = name
        try:
            rows, _ = compare.compare(peer[name], sudu[name])  # A = the peer, B = sudu: B/A = sudu / peer
        except SuduError:
            rows, diffs = compare.compare(peer[name], sudu[name], force=True)
            unlike.append(f"- {name} (marked *): " + "; ".join(diffs))
            shown = name + " *"
        for metric, label, scale in SHOWN.get(name, THROUGHPUT):
            for r in (r for r in rows if r["metric"] == metric):
                lines.append(f"| {shown} | {r['group']}: {label} | {r['mean_b'] * scale:.1f} | "
                             f"{r['mean_a'] * scale:.1f} | {fmt_ratio(r)} |")
        if name.startswith("throughput"):
            s, p = (rep[name]["groups"][0]["throughput"]["mean_tok_s"] for rep in (sudu, peer))
            lines.append(f"| {name} | output tok/s (tokens / window) | {s:.1f} | {p:.1f} | {s / p:.2f}x |")
    if unlike:
        lines += ["", "Not like for like (A: the peer, B: sudu):", *unlike]
    return "\n".join(lines)


def client_check(reports: dict) -> str:
    """Both clients' per-request decode speeds on one server: medians and ranges. The two run one after the
    other with different salts, so their answers (and, with n-gram speculation, what is accepted) differ, and
    the machine can drift between them: a gap between the medians means something only where the ranges do
    not overlap. On one prompt sent back to back, the two agree within 1% (docs/cpu_speed.md)."""
    bench = [r["metrics"]["output_speed_tok_s"] for r in reports["single"]["records"]
             if not r.get("warmup") and r.get("group") == "single" and "output_speed_tok_s" in r.get("metrics", {})]
    independent = reports["independent"]
    if not bench or not independent:
        return "no per-request speeds from one of the clients"

    def summary(v: list[float]) -> str:
        return f"{statistics.median(v):.2f} tok/s [{min(v):.1f}-{max(v):.1f}]"

    gap = statistics.median(bench) / statistics.median(independent) - 1
    overlap = min(max(bench), max(independent)) >= max(min(bench), min(independent))
    return (f"sudu bench {summary(bench)}, independent client {summary(independent)} ({gap:+.1%}; "
            f"ranges {'overlap' if overlap else 'do not overlap'})")


def interleaved(urls: dict[str, str], model: str, n: int, max_tokens: int, settle: float) -> str:
    """The independent client's decode speed on both servers, prompt by prompt, alternating which goes
    first: the median of the per-prompt sudu / llama-server ratios, with a bootstrap 95% CI. Each request
    starts `settle` seconds after the last one ended: the server that just answered finishes its own
    after-request work (threads still spinning, cache bookkeeping) before the other one's request, not
    during it, on a machine whose cores both servers share."""
    prompts = [CHAT_CODE_PROMPTS[i % len(CHAT_CODE_PROMPTS)] for i in range(n)]
    for url in urls.values():
        independent_client.decode_speeds(url, model, prompts[:1], 8)  # warm-up

    def speed(url: str, prompt: str) -> float:
        got = independent_client.decode_speeds(url, model, [prompt], max_tokens, warm=False)
        return got[0] if got else float("nan")

    speeds = alternating(urls, prompts, settle, speed)
    med = {side: statistics.median(v) for side, v in speeds.items()}
    peer = peer_of(urls)
    return (f"sudu {med['sudu']:.1f} tok/s, {peer} {med[peer]:.1f} tok/s; "
            + paired_ratio(speeds["sudu"], speeds[peer]))


def peer_of(sides) -> str:
    """The name of the side that is not sudu."""
    return next(side for side in sides if side != "sudu")


def alternating(urls: dict[str, str], prompts: list[str], settle: float, measure) -> dict[str, list]:
    """measure(url, prompt) on each server for each prompt, the order alternating from prompt to prompt,
    each request `settle` seconds after the last one ended."""
    results = {side: [] for side in urls}
    for i, prompt in enumerate(prompts):
        for side in (list(urls) if i % 2 == 0 else list(reversed(urls))):
            time.sleep(settle)
            results[side].append(measure(urls[side], prompt))
    return results


def paired_ratio(sudu: list[float], peer: list[float]) -> str:
    """The median of the per-pair sudu / peer ratios with a bootstrap 95% CI, and their range."""
    ratios = [a / b for a, b in zip(sudu, peer) if a == a and b == b]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return (f"per-prompt ratio median {statistics.median(ratios):.2f}x [{boot[50]:.2f}, {boot[1949]:.2f}] over "
            f"{len(ratios)} pairs, range {min(ratios):.2f}-{max(ratios):.2f}x")


def prompt_pairs(urls: dict[str, str], model: str, n: int, words: int, settle: float) -> str:
    """Cold-prompt TTFT on both servers, prompt by prompt, alternating which goes first (as `interleaved`):
    each prompt is `words` words of varied text behind a fresh salt, answered with one token, so the
    time is the prompt's processing on each side, a few seconds apart."""
    vocab = " ".join(CHAT_CODE_PROMPTS).split()
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]
    with httpx.Client(timeout=600, headers={"Connection": "close"}) as client:
        for url in urls.values():
            independent_client.time_to_first_token(client, url, model, prompts[0])  # warm-up
        got = alternating(urls, prompts, settle, lambda url, prompt: independent_client.time_to_first_token(
            client, url, model, prompt) or (float("nan"), 0))
    ttft = {side: [t for t, _ in v] for side, v in got.items()}
    tokens = {side: [n for _, n in v] for side, v in got.items()}
    med = {side: statistics.median(v) for side, v in ttft.items()}
    speed = {side: statistics.median(t / s for t, s in zip(tokens[side], ttft[side]) if t) for side in urls}
    peer = peer_of(urls)
    return (f"prompts of {statistics.median(tokens['sudu'])} / {statistics.median(tokens[peer])} tokens; "
            f"TTFT sudu {1e3 * med['sudu']:.0f} ms ({speed['sudu']:.0f} tok/s), {peer} "
            f"{1e3 * med[peer]:.0f} ms ({speed[peer]:.0f} tok/s); TTFT "
            + paired_ratio(ttft["sudu"], ttft[peer]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n-single", type=int, default=10, help="requests of single and of throughput c=1")
    parser.add_argument("--out", default="bench-results/vs-llama-server")
    parser.add_argument("--llama-dir", default=llama_server.DEFAULT_DIR)
    parser.add_argument("--peer", choices=("llama-server", "ik_llama.cpp"), default="llama-server",
                        help="the peer: llama.cpp's llama-server, or ik_llama.cpp's with its run-time repacking (-rtr)")
    parser.add_argument("--ik-dir", default=ik_llama.DEFAULT_DIR, help="where ik_llama.cpp was built (benchmarks/ik_llama.py)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="sudu's KV pool format (auto: the engine's choice)")
    parser.add_argument("--peer-first", action="store_true",
                        help="measure the peer first (run both orders: the VM's speed drifts over minutes)")
    parser.add_argument("--parts", default="runs,interleaved,prompt-pairs")
    parser.add_argument("--n-interleaved", type=int, default=20, help="prompts sent to both servers, alternating")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds between the interleaved requests")
    parser.add_argument("--n-prompt-pairs", type=int, default=8, help="cold prompts sent to both servers (prompt-pairs)")
    parser.add_argument("--prompt-words", type=int, default=400, help="words per prompt-pairs prompt (~500 tokens)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    peer = args.peer
    binary, peer_flags = ((ik_llama.require(args.ik_dir), ["-rtr"]) if peer == "ik_llama.cpp"
                          else (llama_server.require(args.llama_dir), []))
    from sudu.weights.catalog import resolve_model_path

    gguf = str(resolve_model_path(args.model))
    os.makedirs(args.out, exist_ok=True)
    results, memory = {}, {}
    kv_bytes, kv_dtype = kv_memory_for(args.model, SLOTS * 1024, args.kv_cache_dtype)
    print(f"sudu's KV pool: {kv_dtype} ({args.kv_cache_dtype}), {kv_bytes / 2**20:.0f} MiB for {SLOTS} x 1,024 tokens; "
          f"{peer}'s: float16 (its default)", flush=True)
    sides = {
        "sudu": lambda port: [sys.executable, "-m", "sudu.cli", "serve", "--model", args.model, "--port", str(port),
                              "--num-threads", str(args.threads), "--max-num-seqs", str(SLOTS),
                              "--kv-cache-memory", str(kv_bytes), "--kv-cache-dtype", kv_dtype],
        peer: lambda port: [binary, *peer_flags, "-m", gguf, "--alias", args.model, "--port", str(port), "--host",
                                      "127.0.0.1", "-t", str(args.threads), "-np", str(SLOTS), "-c",
                                      # llama-server splits -c over its slots: 1,024 tokens each holds the cache
                                      # suite's 512-token prompts with their chat template and answer
                                      str(SLOTS * 1024)],
    }

    def paired_check() -> None:
        print("independent client, both servers up, prompts alternating:",
              both_up(sides, args, lambda urls: interleaved(urls, args.model, args.n_interleaved, args.max_tokens,
                                                                args.settle)))

    def prompt_check() -> None:
        print("independent client, both servers up, cold prompts alternating:",
              both_up(sides, args, lambda urls: prompt_pairs(urls, args.model, args.n_prompt_pairs, args.prompt_words,
                                                                 args.settle)))

    def paired_checks() -> None:
        if "interleaved" in parts:
            paired_check()
        if "prompt-pairs" in parts:
            prompt_check()

    if "runs" not in parts:
        paired_checks()
        return
    for side in ((peer, "sudu") if args.peer_first else ("sudu", peer)):
        command = sides[side]
        port = free_port()
        proc = start(side, command(port), port, args.out)
        try:
            memory[side] = [rss_mb(proc.pid)[0]]
            t0 = time.perf_counter()
            results[side] = measure(side, f"http://127.0.0.1:{port}/v1", args.model, args)
            memory[side] += rss_mb(proc.pid)
            print(f"{side}: measured in {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            stop_server(proc)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"independent": {s: results[s]["independent"] for s in results}}, f)
    print(f"\n{args.model}, {args.threads} threads, {SLOTS} slots each, cold prompts, --ignore-eos, "
          f"max_tokens {args.max_tokens}\n")
    print(table(results["sudu"], results[peer], peer))
    print("\n| resident set, MiB | after loading | after the runs (32 streams incl.) | peak |\n|---|---:|---:|---:|")
    for side in sides:
        print(f"| {side} | {memory[side][0]:.0f} | {memory[side][1]:.0f} | {memory[side][2]:.0f} |")
    s, p = memory["sudu"], memory[peer]
    print(f"| sudu / {peer} | {s[0] / p[0]:.2f}x | {s[1] / p[1]:.2f}x | {s[2] / p[2]:.2f}x |")
    print("\nmeasuring client vs an independent minimal client (per-request decode speed, median):")
    for side in sides:
        print(f"  {side}: {client_check(results[side])}")
    paired_checks()


def both_up(sides: dict, args, fn):
    """fn({side: url}) with both servers running."""
    procs, urls = [], {}
    try:
        for side, command in sides.items():
            port = free_port()
            procs.append(start(side, command(port), port, args.out))
            urls[side] = f"http://127.0.0.1:{port}/v1"
        return fn(urls)
    finally:
        for proc in procs:
            stop_server(proc)


if __name__ == "__main__":
    main()
