"""Decode speed and memory of the KV pool formats (`--kv-cache-dtype`), side by side in one process.

One engine per format, the same weights (the model's default format). Per format:
  * decode: greedy tokens after the first, per second after the first, of one stream (a prompt of each
    --contexts length) and of --streams streams (distinct prompts of --batch-context tokens). The prompts
    are computed once beforehand (a one-token request leaves them in the prefix cache), so the measured run
    starts every stream within a step or two and times decoding alone;
  * prefill: time to first token of a cold --prefill-context-token prompt (a new text every run): what
    the pool's format costs the prompt's attention (reads converted to float32 for SDPA).
The formats take turns run by run (--repeat rounds), so a drift of the machine falls on all of them alike.
Also printed: KV bytes per token and the tokens the default pool budget holds.

    python -m benchmarks.kv_formats [--model NAME] [--formats float32,float16,bfloat16,int8] [--contexts 512,4000]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

from benchmarks.engine_throughput import filler_ids


def decode_rate(llm, prompts: list[list[int]], tokens: int) -> float:
    """Generated tokens after each stream's first, per second of wall time after the last first token (the
    prompts cached first, so that all streams decode together from the start)."""
    from sudu.sampling import SamplingParams

    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts, params)
    first = max(r.metrics.first_token_time for r in results)
    last = max(r.metrics.finished_time for r in results)
    return sum(len(r.token_ids) - 1 for r in results) / (last - first)


def ttft(llm, prompt: list[int]) -> float:
    from sudu.sampling import SamplingParams

    r = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return r.metrics.first_token_time - r.metrics.arrival_time


def main() -> None:
    from sudu.engine.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--formats", default="float32,float16,bfloat16,int8")
    parser.add_argument("--contexts", default="512,4000", help="single-stream prompt lengths")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per stream")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--batch-context", type=int, default=512)
    parser.add_argument("--prefill-context", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    formats = args.formats.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]

    llms = {}
    for kv in formats:
        t0 = time.perf_counter()
        print(f"loading {args.model} with a {kv} KV pool ...", flush=True)
        llm = LLM(args.model, progress=False, kv_cache_dtype=kv, num_threads=args.threads,
                  max_num_seqs=max(args.streams, 1))
        if kv == "auto":
            print(f"  auto chose {llm.engine.config.kv_cache_dtype}: {llm.engine.kv_choice.reason}")
        llms[kv] = llm
        print(f"  {time.perf_counter() - t0:.1f} s; {llm.engine.runner.kv_bytes_per_token()} KV bytes a token, "
              f"{llm.engine.runner.num_blocks * llm.engine.config.block_size} tokens in the default budget",
              flush=True)
    tok = next(iter(llms.values())).tokenizer
    cases = [(f"1 stream, {c}-token context", [filler_ids(tok, c, seed=c)]) for c in contexts]
    cases.append((f"{args.streams} streams, {args.batch_context}-token contexts",
                  [filler_ids(tok, args.batch_context, seed=100 + i) for i in range(args.streams)]))
    prefill_name = f"prefill: TTFT of a cold {args.prefill_context}-token prompt, ms"
    rates = {(name, kv): [] for name, _ in cases + [(prefill_name, None)] for kv in formats}
    for r in range(args.repeat):
        for name, prompts in cases:
            for kv, llm in llms.items():
                rates[(name, kv)].append(decode_rate(llm, prompts, args.tokens))
                gc.collect()
        for i, (kv, llm) in enumerate(llms.items()):
            salt = tok.encode(f"Run {r}, pool {kv}.\n", add_special_tokens=False)  # cold: its own first block
            prompt = salt + filler_ids(tok, args.prefill_context - len(salt), seed=1000 + r * len(formats) + i)
            rates[(prefill_name, kv)].append(1000 * ttft(llm, prompt))
        print(f"round {r + 1}/{args.repeat} done", flush=True)
    cases.append((prefill_name, None))

    print(f"\n{args.model}, {args.threads} threads, {args.tokens} greedy tokens per stream, {args.repeat} alternating "
          f"rounds: median (range) and / {formats[0]}; decode rows in tok/s after the first token (higher is faster), the "
          "prefill row in ms (lower is faster)\n")
    base = formats[0]
    print("| case | " + " | ".join(formats) + " |\n|---|" + "---:|" * len(formats))
    for name, _ in cases:
        cells = []
        for kv in formats:
            xs = rates[(name, kv)]
            ratio = statistics.median(xs) / statistics.median(rates[(name, base)])
            cells.append(f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f}) {ratio:.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n| format | KV bytes a token | tokens in the default budget |\n|---|---:|---:|")
    for kv, llm in llms.items():
        print(f"| {kv} | {llm.engine.runner.kv_bytes_per_token()} | "
              f"{llm.engine.runner.num_blocks * llm.engine.config.block_size} |")


if __name__ == "__main__":
    main()
