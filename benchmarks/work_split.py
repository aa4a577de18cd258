"""How qlinear's threads split a call's tiles, both ways in one process: each thread streaming a contiguous
share (taking chunks from the back of the others' when done) against chunks from one shared counter in
turn (kernels set_contiguous_shares). Decode steps alternate the split step by step, so the VM's drift
reaches both alike; cold prompts alternate prompt by prompt (the order reversed every round). Prints the
median step (or prompt) time per split and the ratio of the medians. Both splits compute the same values
(tests/test_linear.py).

    flock /tmp/sudu-bench.lock python -m benchmarks.work_split [--model M] [--batch 1,8] [--tokens 590] \\
        [--steps 400] [--rounds 6]
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time

import torch

from benchmarks.prefill_chunks import cold_prompts_in_turn
from sudu import kernels
from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams

SPLITS = ("contiguous shares", "shared counter")


def decode_steps(llm: LLM, ext, batch: int, steps: int) -> dict[str, list[float]]:
    """Seconds per engine step of `batch` greedy streams, the split switched before every step."""
    times: dict[str, list[float]] = {s: [] for s in SPLITS}
    step, turn = llm.engine.step, itertools.cycle(SPLITS)

    def alternating():
        split = next(turn)
        ext.set_contiguous_shares(split == SPLITS[0])
        start = time.perf_counter()
        out = step()
        times[split].append(time.perf_counter() - start)
        return out

    llm.engine.step = alternating
    try:
        prompts = [f"Write a Python function number {i} that checks whether a string is a palindrome."
                   for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.step = step
    times[SPLITS[0]].pop(0)  # the prompt's step, the first
    return times


def ratio_line(label: str, times: dict[str, list[float]], unit: float, name: str) -> str:
    med = {s: statistics.median(v) for s, v in times.items()}
    return (f"  {label}: " + "; ".join(f"{s} {unit * m:.2f} {name}" for s, m in med.items())
            + f"; contiguous / counter {med[SPLITS[0]] / med[SPLITS[1]]:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--batch", default="1,8", help="decode batch sizes ('' for none)")
    p.add_argument("--steps", type=int, default=400, help="decode steps per batch size")
    p.add_argument("--tokens", default="590", help="cold prompt lengths ('' for none)")
    p.add_argument("--rounds", type=int, default=6, help="cold prompts per split and length")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    try:
        batches = [int(b) for b in args.batch.split(",") if b]
        lengths = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        sys.exit("work_split: --batch and --tokens must be comma-separated integers")
    if min(batches + lengths + [args.steps, args.rounds, args.threads]) < 1:
        sys.exit("work_split: --batch, --tokens, --steps, --rounds and --threads must be positive")
    ext = kernels.load()
    if ext is None:
        sys.exit("work_split: the native kernels did not build on this machine")
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, speculative="none", progress=False, enable_prefix_caching=False, num_threads=args.threads)
    llm.generate(["warm up"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    before = ext.set_contiguous_shares(True)
    print(f"{args.model}, {args.threads} threads, kernels {ext.isa()}", flush=True)
    try:
        for batch in batches:
            times = decode_steps(llm, ext, batch, args.steps)
            print(ratio_line(f"decode batch {batch}, median step of {len(times[SPLITS[0]])}", times, 1e3, "ms"),
                  flush=True)
        rng = random.Random(0)
        for n in lengths:
            times = cold_prompts_in_turn(llm, rng, n, list(SPLITS), args.rounds,
                                         lambda split: ext.set_contiguous_shares(split == SPLITS[0]))
            print(ratio_line(f"cold {n}-token prompt, median of {args.rounds}", times, 1e3, "ms"), flush=True)
    finally:
        ext.set_contiguous_shares(before)


if __name__ == "__main__":
    main()
