"""Does a request's answer depend on what else the engine computes? Greedy (and seeded) generations of a
few everyday prompts, each alone on a fresh engine with no prefix cache (the reference), then: all
together in one batch, after a part of the prompt was cached, under small chunk budgets. Prints, per
run, how many requests match the reference token for token, the first divergence and the largest
logprob difference where the tokens still agree.

    python -m benchmarks.invariance                      # the default model, the engine's defaults
    python -m benchmarks.invariance --fast-math          # the opt-in non-invariant prompt path
    python -m benchmarks.invariance --model PATH --tokens 48 --prompts 8 --threads 1
"""
from __future__ import annotations

import argparse

from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams

PROMPTS = [
    "Write a haiku about caches.",
    "Explain what a hash map is in two sentences.",
    "def fibonacci(n):",
    "Translate 'good morning' into French, Spanish and German.",
    "List three uses of the Python zip function, with a short example of each one.",
    "What is the difference between a process and a thread? Answer briefly for a beginner who knows some C.",
    "Write a SQL query that returns the ten most recent orders with their customer's name and total price.",
    "Summarize the plot of Romeo and Juliet in one paragraph, then give one lesson a reader might take from it "
    "and why it still matters today.",
]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(name: str, ref: list, got: list) -> int:
    """Prints one line per run; returns how many match the reference exactly (tokens and logprobs)."""
    same = 0
    lines = []
    for i, (r, g) in enumerate(zip(ref, got)):
        d = first_divergence(r.token_ids, g.token_ids)
        n = len(r.token_ids) if d is None else d
        lp_diff = max((abs(a.logprob - b.logprob) for a, b in zip(r.outputs[0].logprobs[:n], g.outputs[0].logprobs[:n])),
                      default=0.0)
        if d is None and lp_diff == 0.0:
            same += 1
        else:
            lines.append(f"    prompt {i}: first divergent token {d}, max |logprob diff| before it {lp_diff:.3g}")
    print(f"{name:34s} {same}/{len(ref)} identical", flush=True)
    for line in lines:
        print(line)
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--fast-math", action="store_true")
    ap.add_argument("--speculative", default="auto")
    ap.add_argument("--seeded", action="store_true", help="temperature 0.8 with a seed per prompt instead of greedy")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    args = ap.parse_args()
    common = dict(progress=False, speculative=args.speculative, fast_math=args.fast_math, num_threads=args.threads)
    if args.model:
        common["model"] = args.model

    def params(i: int) -> SamplingParams:
        if args.seeded:
            return SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=args.tokens, ignore_eos=True, logprobs=0)
        return SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0)

    cold = LLM(enable_prefix_caching=False, **common)
    tok = cold.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    ref = [cold.generate([p], params(i))[0] for i, p in enumerate(prompts)]
    total = same = 0
    batch = cold.generate(prompts, [params(i) for i in range(len(prompts))])
    same += compare("batched together", ref, batch)
    total += len(prompts)
    for budget in (16, 64):
        llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=budget, **common)
        same += compare(f"chunk budget {budget}, batched", ref, llm.generate(prompts, [params(i) for i in range(len(prompts))]))
        total += len(prompts)
        del llm
    warm = LLM(enable_prefix_caching=True, **common)
    for frac in (0.5, 0.9):
        got = []
        for i, p in enumerate(prompts):
            warm.generate([p[:max(1, int(len(p) * frac))]], SamplingParams(max_tokens=1))
            got.append(warm.generate([p], params(i))[0])
        same += compare(f"{int(frac * 100)}% of prompt sent first", ref, got)
        total += len(prompts)
    print(f"overall: {same}/{total} runs identical to the cold, alone reference")


if __name__ == "__main__":
    main()
