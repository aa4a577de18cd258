"""Two ways the kernels can run a call, both in one process, switched step by step for decode and prompt
by prompt for cold prompts, so the VM's drift reaches both alike (the order reversed every round). Prints
the median step (or prompt) time per way and the ratio of the medians. Both ways compute the same values
(tests/test_linear.py). --switch picks the two:
- shares (default): how qlinear's threads split a call's tiles, each thread streaming a contiguous share
  (taking chunks from the back of the others' when done) against chunks from one shared counter in turn
  (kernels.h KernelOptions::contiguous_shares);
- fused-silu: silu(gate) * up inside the gate_up call (qlinear_silu) against a silu_mul pass after it
  (KernelOptions::fused_silu);
- attention-512: attention's score and value products on AVX-512 against AVX2 (KernelOptions::attention512;
  the same bits), e.g. with --tokens 8192 for a prompt deep enough for attention to matter.

    flock /tmp/sudu-bench.lock python -m benchmarks.work_split [--switch shares|fused-silu|attention-512] [--model M] \\
        [--batch 1,8] [--tokens 590] [--steps 400] [--rounds 6]
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

# --switch: (its two ways, the first being the default; the kernel option that is on for the first)
SWITCHES = {
    "shares": (("contiguous shares", "shared counter"), "contiguous_shares"),
    "fused-silu": (("silu in gate_up", "silu_mul after"), "fused_silu"),
    "attention-512": (("AVX-512 attention", "AVX2 attention"), "attention512"),
}


def decode_steps(llm: LLM, ways: tuple[str, str], use, batch: int, steps: int) -> dict[str, list[float]]:
    """Seconds per engine step of `batch` greedy streams, use(way) before every step, in turn."""
    times: dict[str, list[float]] = {s: [] for s in ways}
    step, turn = llm.engine.step, itertools.cycle(ways)

    def alternating():
        split = next(turn)
        use(split)
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
    times[ways[0]].pop(0)  # the prompt's step, the first
    return times


def ratio_line(label: str, times: dict[str, list[float]], unit: float, name: str) -> str:
    med = {s: statistics.median(v) for s, v in times.items()}
    first, second = list(med)
    return (f"  {label}: " + "; ".join(f"{s} {unit * m:.2f} {name}" for s, m in med.items())
            + f"; {first} / {second} {med[first] / med[second]:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--switch", choices=sorted(SWITCHES), default="shares")
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
    ways, option = SWITCHES[args.switch]
    before = ext.kernel_options()

    def use(way: str) -> None:
        changed = ext.kernel_options()
        setattr(changed, option, way == ways[0])
        ext.set_kernel_options(changed)

    print(f"{args.model}, {args.threads} threads, kernels {ext.isa()}", flush=True)
    try:
        for batch in batches:
            times = decode_steps(llm, ways, use, batch, args.steps)
            print(ratio_line(f"decode batch {batch}, median step of {len(times[ways[0]])}", times, 1e3, "ms"),
                  flush=True)
        rng = random.Random(0)
        for n in lengths:
            times = cold_prompts_in_turn(llm, rng, n, list(ways), args.rounds, use)
            print(ratio_line(f"cold {n}-token prompt, median of {args.rounds}", times, 1e3, "ms"), flush=True)
    finally:
        ext.set_kernel_options(before)


if __name__ == "__main__":
    main()
