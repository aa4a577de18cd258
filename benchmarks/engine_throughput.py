"""Engine benchmarks (issue: Engine), side by side in one run on the default model, 2 threads.

1. offline throughput: N requests (default 64), prompts 100-500 tokens, outputs 100-300 tokens (seeded),
   greedy, EOS ignored. sudu's LLM.generate vs transformers' batched generate with left padding at its
   best batch size (probed first on a short run at each candidate size). Useful output tokens / wall time.
2. cold vs warm TTFT with a 2,000-token shared prefix: each cold request has a unique salt at the start;
   each warm one shares the prefix with the request before it (distinct tail). Target warm <= 10% cold.
3. ITL p99 of 4 decoding streams while a 4,000-token prompt arrives, vs the same 4 streams alone.
   Target <= 3x with chunked prefill.
4. a burst: N requests (default 32, ~200-token distinct prompts, 64 tokens out) arriving at once, with
   the auto chunk budget and with fixed ones (max_num_batched_tokens: vLLM's chunked prefill), alternating
   rounds: wall time, output tok/s, mean TTFT, the decoders' ITL p99.

    python -m benchmarks.engine_throughput [--parts 1,2,3,4] [--requests 64] [--burst-chunks 0,512]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams

MODEL = "qwen2.5-coder-0.5b-instruct"


def filler_ids(tokenizer, n: int, seed: int) -> list[int]:
    """n token ids of varied real text (this file's source, rotated by seed)."""
    text = open(__file__).read()
    ids = tokenizer.encode(text, add_special_tokens=False)
    start = seed * 37 % len(ids)
    out = (ids[start:] + ids) * (n // len(ids) + 2)
    return out[:n]


def workload(tokenizer, n: int, seed: int = 0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = tokenizer.encode(f"Request {i}: continue the text.\n", add_special_tokens=False)
        prompt += filler_ids(tokenizer, rng.randint(100, 500) - len(prompt), seed + i)
        reqs.append((prompt, rng.randint(100, 300)))
    return reqs


def part_throughput(llms: dict[str, LLM], n: int, hf_sizes: list[int]) -> None:
    """llms: sudu engines by label (its default weight format, and float32 like transformers)."""
    from benchmarks.hf_baseline import hf_generate, load_hf

    first = next(iter(llms.values()))
    reqs = workload(first.tokenizer, n)
    useful = sum(m for _, m in reqs)
    print(f"\n## 1. offline throughput: {n} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{useful} output tokens", flush=True)
    sudu_s = {}
    for label, llm in llms.items():
        t0 = time.perf_counter()
        results = llm.generate([p for p, _ in reqs],
                               [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in reqs])
        sudu_s[label] = time.perf_counter() - t0
        assert sum(len(r.token_ids) for r in results) == useful
        print(f"sudu {label}: {sudu_s[label]:.1f} s, {useful / sudu_s[label]:.1f} output tok/s", flush=True)

    hf, _ = load_hf(MODEL)
    pad = first.tokenizer.pad_token_id or 0
    probe = {}
    for bs in hf_sizes:  # short probe: the same kind of batch, 16 new tokens
        batch = [p for p, _ in reqs[:bs]]
        _, s = hf_generate(hf, batch, 16, pad)
        probe[bs] = bs * 16 / s
        print(f"transformers probe batch {bs}: {probe[bs]:.1f} tok/s", flush=True)
    best = max(probe, key=probe.get)
    t0 = time.perf_counter()
    for i in range(0, n, best):
        chunk = reqs[i:i + best]
        hf_generate(hf, [p for p, _ in chunk], max(m for _, m in chunk), pad)
        print(f"transformers: {min(i + best, n)}/{n} requests, {time.perf_counter() - t0:.0f} s", flush=True)
    hf_s = time.perf_counter() - t0
    print("\n| engine | wall s | useful output tok/s | vs transformers |\n|---|---|---|---|")
    for label, t in sudu_s.items():
        print(f"| sudu {label} (continuous batching) | {t:.1f} | {useful / t:.1f} | {hf_s / t:.2f}x |")
    print(f"| transformers generate float32, batch {best} (best of {hf_sizes}) | {hf_s:.1f} | {useful / hf_s:.1f} | 1.00x |")
    print("target: >= 3x", flush=True)
    del hf


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    r = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return r.metrics.first_token_time - r.metrics.arrival_time, r.num_cached_tokens


def part_prefix(llm: LLM, repeat: int) -> None:
    print("\n## 2. TTFT with a 2,000-token shared prefix, cold vs warm", flush=True)
    tok = llm.tokenizer
    cold, warm = [], []
    for i in range(repeat):
        salt = tok.encode(f"salt {random.random()}\n", add_special_tokens=False)
        prefix = salt + filler_ids(tok, 2000 - len(salt), 1000 + i)
        t_cold, c_cold = ttft(llm, prefix + tok.encode("Question A?", add_special_tokens=False))
        t_warm, c_warm = ttft(llm, prefix + tok.encode("Question B, different?", add_special_tokens=False))
        cold.append(t_cold)
        warm.append(t_warm)
        print(f"run {i + 1}: cold {t_cold:.2f} s ({c_cold} cached), warm {t_warm:.3f} s ({c_warm} cached)", flush=True)
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"\n| state | TTFT s (median of {repeat}) |\n|---|---|\n| cold | {c:.3f} |\n| warm | {w:.3f} |")
    print(f"warm / cold: {100 * w / c:.1f}% (target <= 10%)", flush=True)


def itl_of_streams(llm: LLM, n_streams: int, long_prompt: list[int] | None,
                   tokens: int) -> tuple[list[float], float | None]:
    """ITL gaps of n_streams decoding streams, and (when a long prompt arrives mid-way) that prompt's TTFT."""
    eng = llm.engine
    tok = llm.tokenizer
    for i in range(n_streams):
        eng.add_request(f"s{i}-{random.random()}", filler_ids(tok, 64, 7 * i),
                        SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    last: dict[str, float] = {}
    gaps: list[float] = []
    steps = 0
    long_id, long_arrival, long_ttft = None, 0.0, None
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        steps += 1
        if steps == 6 and long_prompt is not None:  # the streams are decoding: the long prompt arrives
            long_id, long_arrival = f"long-{random.random()}", time.perf_counter()
            eng.add_request(long_id, long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
        for o in outs:
            if o.request_id == long_id and long_ttft is None and any(c.token_ids for c in o.outputs):
                long_ttft = now - long_arrival
            if not o.request_id.startswith("s") or not any(c.token_ids for c in o.outputs):
                continue
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
    return gaps, long_ttft


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def part_itl(llm: LLM, tokens: int) -> None:
    print(f"\n## 3. ITL of 4 decoding streams while a 4,000-token prompt arrives "
          f"(max_num_batched_tokens={llm.engine.config.max_num_batched_tokens}, prefill_chunk_when_decoding="
          f"{llm.engine.config.prefill_chunk_when_decoding or 'auto'}, max_itl_factor "
          f"{llm.engine.config.max_itl_factor})", flush=True)
    base, _ = itl_of_streams(llm, 4, None, tokens)
    long_prompt = filler_ids(llm.tokenizer, 4000, 4242)
    mixed, long_ttft = itl_of_streams(llm, 4, long_prompt, tokens)
    alone = ttft(llm, filler_ids(llm.tokenizer, 4000, 4343))[0]  # another text: nothing cached
    print("\n| case | ITL median ms | ITL p99 ms |\n|---|---|---|")
    print(f"| 4 streams alone | {1000 * statistics.median(base):.0f} | {1000 * p99(base):.0f} |")
    print(f"| + a 4,000-token prompt arriving | {1000 * statistics.median(mixed):.0f} | {1000 * p99(mixed):.0f} |")
    print(f"p99 ratio: {p99(mixed) / p99(base):.2f}x (target <= 3x)")
    print(f"the price: the long prompt's TTFT {long_ttft:.1f} s among the streams vs {alone:.1f} s alone", flush=True)


def burst(llm: LLM, n: int, prompt_tokens: int, out_tokens: int) -> dict:
    """n requests added at once; stepped to the end. Distinct prompts: nothing is served from the cache."""
    eng = llm.engine
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    tag = random.random()
    arrival = time.perf_counter()
    for i in range(n):
        eng.add_request(f"b{i}-{tag}", filler_ids(llm.tokenizer, prompt_tokens, 1000 + 13 * i + int(tag * 1e6)), params)
    first, last, gaps = {}, {}, []
    steps = 0
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            if not any(c.token_ids for c in o.outputs):
                continue
            first.setdefault(o.request_id, now - arrival)
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
    wall = time.perf_counter() - arrival
    return {"wall": wall, "tok_s": n * out_tokens / wall, "ttft": statistics.mean(first.values()),
            "itl_p99": p99(gaps), "steps": steps}


def part_burst(chunks: list[int], threads: int, n: int, rounds: int) -> None:
    print(f"\n## 4. a burst of {n} requests arriving at once (~200-token prompts, 64 tokens out), "
          f"{rounds} alternating rounds", flush=True)
    llms = {c: LLM(MODEL, speculative="none", num_threads=threads, prefill_chunk_when_decoding=c) for c in chunks}
    for llm in llms.values():  # warm: kernels, allocator, and the chunk budget's first decode-only timings
        llm.generate([filler_ids(llm.tokenizer, 64, 1)], SamplingParams(max_tokens=16, temperature=0.0))
    rows = {c: [] for c in chunks}
    for r in range(rounds):
        for c, llm in llms.items():
            rows[c].append(burst(llm, n, 200, 64))
            m = rows[c][-1]
            print(f"round {r + 1}, chunk {c or 'auto'}: {m['wall']:.1f} s, {m['tok_s']:.1f} tok/s, "
                  f"TTFT {m['ttft']:.2f} s, ITL p99 {1000 * m['itl_p99']:.0f} ms, {m['steps']} steps", flush=True)
    print("\n| prompt tokens per step while decoding | wall s | output tok/s | mean TTFT s | ITL p99 ms | steps |\n"
          "|---|---:|---:|---:|---:|---:|")
    for c, ms in rows.items():
        med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        label = "auto (max_itl_factor)" if c == 0 else f"fixed {c}"
        print(f"| {label} | {med['wall']:.1f} | {med['tok_s']:.1f} | {med['ttft']:.2f} | "
              f"{1000 * med['itl_p99']:.0f} | {med['steps']:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="1,2,3")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="8,16,32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--itl-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--burst-requests", type=int, default=32)
    ap.add_argument("--burst-chunks", default="0,512", help="prefill_chunk_when_decoding values (0 = auto)")
    # Part 1 runs sudu once per format listed: its default (auto: int4 for the GGUF checkpoint) and float32,
    # the same weights as transformers (isolating the engine: batching, caching, scheduling). Parts 2-3
    # use the first.
    ap.add_argument("--quantization", default="auto,none")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parts = {int(p) for p in args.parts.split(",")}
    if 4 in parts:
        part_burst([int(c) for c in args.burst_chunks.split(",")], args.threads, args.burst_requests, args.repeat)
        if parts == {4}:
            return
    llms = {}
    for q in args.quantization.split(","):
        engine = LLM(MODEL, speculative="none", num_threads=args.threads, quantization=q, max_num_seqs=64)
        llms[f"{q} ({engine.engine.quantization})"] = engine
    llm = next(iter(llms.values()))
    print(f"model {MODEL}, {args.threads} threads, quantization {', '.join(llms)}, "
          f"max_num_batched_tokens {llm.engine.config.max_num_batched_tokens}", flush=True)
    if 2 in parts:
        part_prefix(llm, args.repeat)
    if 3 in parts:
        part_itl(llm, args.itl_tokens)
    if 1 in parts:
        part_throughput(llms, args.requests, [int(x) for x in args.hf_batch_sizes.split(",")])


if __name__ == "__main__":
    main()
