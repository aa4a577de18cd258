"""Where a decode step's time goes (issue: CPU speed II, per-step overhead): the engine's step phases timed
by wrapping them (schedule; the runner's input preparation; the decoder stack, native or layers; the output
head; sampling and postprocessing), median over the decode steps of `batch` greedy streams of 96 tokens,
two rounds.

    flock /tmp/sudu-bench.lock python -m benchmarks.step_profile [--model M] [--quantization auto] [--batch 1]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
ap.add_argument("--quantization", default="auto")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(args.threads)
model_name, quant, batch = args.model, args.quantization, args.batch
llm = LLM(model_name, progress=False, quantization=quant, num_threads=args.threads)
eng = llm.engine; runner = eng.runner; model = runner.model
T = {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); T.setdefault(key, []).append(time.perf_counter() - t0); return r
    setattr(obj, name, g)
wrap(eng, "_schedule", "schedule"); wrap(eng, "_run", "run"); wrap(eng, "_postprocess", "postprocess"); wrap(eng, "step", "step")
wrap(model, "forward", "forward"); wrap(model, "compute_logits", "head")
if model._native_decode:
    fn, w, e, m = model._native_decode
    def tf(*a):
        t0 = time.perf_counter(); r = fn(*a); T.setdefault("decoder stack (native)", []).append(time.perf_counter() - t0); return r
    model._native_decode = (tf, w, e, m)
p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
llm.generate(["warm up"] * batch, p)
prompts = [f"Write a Python function number {i} that checks whether a string is a palindrome." for i in range(batch)]
for rnd in range(2):
    T.clear()
    p = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, p)
    # decode steps only: drop the first (prefill) calls
    med = {k: statistics.median(v[2:]) * 1e3 for k, v in T.items()}
    step = med["step"]
    out = {"step": step}
    for k in ("schedule", "forward", "decoder stack (native)", "head", "postprocess"):
        if k in med: out[k] = med[k]
    out["runner python (run - forward - head)"] = med["run"] - med["forward"] - med["head"]
    out["forward python (forward - native)"] = med["forward"] - med.get("decoder stack (native)", 0)
    out["engine python (step - run - postprocess - schedule)"] = step - med["run"] - med["postprocess"] - med["schedule"]
    print(f"{model_name} {quant} batch {batch} round {rnd+1}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in out.items()), flush=True)
