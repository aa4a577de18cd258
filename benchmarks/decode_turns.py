"""Decode speed at depth through the engine: a D-token prompt is warmed once (prefix cache), then turns that
each add a few new tokens after it and decode 128: decode tok/s = 128 / (time of a 129-token answer - time of
a 1-token answer on the same cached prefix), so neither the prompt nor the first token counts.

To compare two source trees (a layout or kernel change), run it from each by turns, each tree with its own
SUDU_HOME (its kernels' build) sharing the models (benchmarks/native_kernels.py shows the worktree recipe):

    flock /tmp/sudu-bench.lock python -m benchmarks.decode_turns --depth 24000 [--turns 3]
"""
from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=24000, help="prompt tokens, roughly (filler words)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams

    llm = LLM(args.model, progress=False, speculative="none")
    words = "the cache holds a block of keys and values for every layer while decode reads them".split()
    rng = random.Random(1)
    text = " ".join(rng.choice(words) for _ in range(int(args.depth / 1.08)))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    prompt_tokens = len(llm.generate([text], one)[0].prompt_token_ids)
    print(f"warmed {prompt_tokens} prompt tokens in {time.perf_counter() - t:.1f} s", flush=True)
    rates = []
    for i in range(args.turns):
        t = time.perf_counter()
        llm.generate([f"{text} turn {i} a"], one)
        first = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([f"{text} turn {i} b"], many)
        rates.append(128 / (time.perf_counter() - t - first))
        print(f"turn {i + 1}: decode {rates[-1]:.1f} tok/s at depth {prompt_tokens}", flush=True)
    print(f"depth {prompt_tokens}: decode tok/s {' '.join(f'{r:.1f}' for r in rates)}")


if __name__ == "__main__":
    main()
