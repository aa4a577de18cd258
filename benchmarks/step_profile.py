"""Where a decode step's time goes (issue: CPU speed II, per-step overhead): the engine's step phases timed
by wrapping them (schedule; the runner's input preparation; the decoder stack, native or layers; the output
head; sampling and postprocessing), median over the decode steps of `batch` greedy streams of 96 tokens,
two rounds.

    flock /tmp/sudu-bench.lock python -m benchmarks.step_profile [--model M] [--quantization auto] [--batch 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams

NATIVE = "decoder stack (native)"


def timed(fn, key: str, times: dict[str, list[float]]):
    """fn, its call durations appended to times[key]."""
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(key, []).append(time.perf_counter() - t0)
    return call


def instrument(llm: LLM, times: dict[str, list[float]]) -> None:
    eng, model = llm.engine, llm.engine.runner.model
    for obj, name, key in ((eng, "_schedule", "schedule"), (eng, "_run", "run"), (eng, "_postprocess", "postprocess"),
                           (eng, "step", "step"), (model, "forward", "forward"), (model, "compute_logits", "head")):
        setattr(obj, name, timed(getattr(obj, name), key, times))
    if getattr(model, "_native_decode", None):
        fn, *rest = model._native_decode
        model._native_decode = (timed(fn, NATIVE, times), *rest)


def phases(times: dict[str, list[float]]) -> dict[str, float]:
    """Medians in ms over the decode steps (the first two calls of each phase, the prompt's, left out),
    and the host work between the timed calls."""
    med = {k: statistics.median(v[2:]) * 1e3 for k, v in times.items()}
    out = {k: med[k] for k in ("step", "schedule", "forward", NATIVE, "head", "postprocess") if k in med}
    out["runner python (run - forward - head)"] = med["run"] - med["forward"] - med["head"]
    out["forward python (forward - native)"] = med["forward"] - med.get(NATIVE, 0.0)
    out["engine python (step - run - postprocess - schedule)"] = med["step"] - med["run"] - med["postprocess"] - med["schedule"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, speculative="none", progress=False, quantization=args.quantization, num_threads=args.threads)
    times: dict[str, list[float]] = {}
    instrument(llm, times)
    llm.generate(["warm up"] * args.batch, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    prompts = [f"Write a Python function number {i} that checks whether a string is a palindrome."
               for i in range(args.batch)]
    for rnd in range(2):
        times.clear()
        llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True))
        print(f"{args.model} {args.quantization} batch {args.batch} round {rnd + 1}: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in phases(times).items()), flush=True)


if __name__ == "__main__":
    main()
