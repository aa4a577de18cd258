"""A cold prompt's time in the engine (prefix cache off, one-token answer) under several prompt chunk
budgets (max_num_batched_tokens), switched between requests of one engine and taken in rotation so that the
machine's drift over minutes reaches each budget alike; median of --rounds fresh random prompts per budget.

    flock /tmp/sudu-bench.lock python -m benchmarks.prefill_chunks [--model M] [--tokens 590,2000] [--budgets 512,1024,2048]

Every chunk dequantizes the weights once for its GEMMs (layers/linear.py), and a chunk's tail of fewer than
PREFILL_MIN_ROWS rows goes through the integer kernels at a far lower rate: a prompt cut into fewer chunks
costs less (docs/cpu_speed.md).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--tokens", default="590,2000", help="prompt lengths")
    p.add_argument("--budgets", default="512,1024,2048", help="max_num_batched_tokens values")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    if min(lengths + budgets) < 1 or args.rounds < 1:
        sys.exit("prefill_chunks: --tokens, --budgets and --rounds must be positive")
    llm = LLM(args.model, progress=False, max_num_batched_tokens=max(budgets), enable_prefix_caching=False)
    scheduler, rng = llm.engine.scheduler, random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([[rng.randrange(1000, 20000) for _ in range(300)]], params)  # warm-up
    print(f"{args.model}: cold prompt, seconds (median of {args.rounds}) per max_num_batched_tokens", flush=True)
    for n in lengths:
        times = cold_prompts_in_turn(llm, rng, n, budgets, args.rounds,
                                     lambda b: setattr(scheduler, "max_num_batched_tokens", b))
        cells = ", ".join(f"{b}: {statistics.median(v):.3f} s" for b, v in times.items())
        print(f"  {n:5} tokens  {cells}", flush=True)


def cold_prompts_in_turn(llm: LLM, rng: random.Random, n: int, settings: list, rounds: int, apply) -> dict:
    """Seconds per cold prompt of n random tokens (a one-token answer) under each setting, `apply(setting)`
    before each prompt: the settings in turn, their order reversed every round, so that the machine's drift
    over minutes reaches each alike. {setting: [seconds per round]}."""
    params = SamplingParams(max_tokens=1, temperature=0)
    times: dict = {s: [] for s in settings}
    for r in range(rounds):
        for setting in settings if r % 2 == 0 else settings[::-1]:
            apply(setting)
            ids = [rng.randrange(1000, 20000) for _ in range(n)]
            t0 = time.perf_counter()
            llm.generate([ids], params)
            times[setting].append(time.perf_counter() - t0)
        print(f"  {n} tokens: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return times


if __name__ == "__main__":
    main()
