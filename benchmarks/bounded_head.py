"""The bounded head (layers/bounded_head.py) against the whole head, in one process: greedy decode steps with
the bounded head and without it, switched step by step (benchmarks/work_split.py decode_steps), so the VM's
drift reaches both alike. Prints the median step time of each and their ratio, what the bounded head read
(candidate tiles per call, calls that ran the whole head), the time its build took, and whether the tokens
of greedy generations are the same both ways.

    flock /tmp/sudu-bench.lock python -m benchmarks.bounded_head [--model M] [--batch 1,8,32] [--steps 300] \\
        [--speculative none|auto]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.work_split import decode_steps, ratio_line
from sudu.engine.llm import LLM
from sudu.engine.text_eval import final_hidden
from sudu.layers import bounded_head
from sudu.layers.kv_cache import calibration_ids
from sudu.sampling import SamplingParams

WAYS = ("bounded head", "whole head")
PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain the difference between TCP and UDP in a short paragraph.",
           "Once upon a time, in a small village,",
           "List the planets of the solar system with one fact about each.",
           "def merge_sort(items):",
           "Translate to French: The weather is nice today and we are going to the beach."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--batch", default="1,8", help="decode batch sizes")
    p.add_argument("--steps", type=int, default=300, help="decode steps per batch size")
    p.add_argument("--speculative", default="none", help="the engine's --speculative (none: one token a step)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    try:
        batches = [int(b) for b in args.batch.split(",") if b]
    except ValueError:
        sys.exit("bounded_head: --batch must be comma-separated integers")
    if not batches or min(batches + [args.steps, args.threads]) < 1:
        sys.exit("bounded_head: --batch, --steps and --threads must be positive")
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, speculative=args.speculative, progress=False, enable_prefix_caching=False,
              num_threads=args.threads)
    runner = llm.engine.runner
    bounded = runner.bounded_head
    if bounded is None:
        sys.exit(f"bounded_head: {args.model}'s output head is not one the bounded head serves (8-bit tiles)")
    start = time.perf_counter()
    bounded_head.build(runner.model, lambda: final_hidden(runner.model, calibration_ids(llm.engine.tokenizer, runner.model_cfg)))
    print(f"{args.model}, {args.threads} threads, speculative {args.speculative}: head {runner.model.lm_head.weight_bytes() / 1e6:.0f} MB, "
          f"the bounded head's shadow and constants {bounded.shadow_bytes() / 1e6:.0f} MB, built in "
          f"{time.perf_counter() - start:.1f} s (calibration pass included)", flush=True)

    greedy = SamplingParams(max_tokens=96, temperature=0.0)
    outs = {}
    for way in WAYS:
        runner.bounded_head = bounded if way == WAYS[0] else None
        outs[way] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    same = sum(a == b for a, b in zip(*outs.values()))
    print(f"  greedy generations with the same tokens both ways: {same} of {len(PROMPTS)}", flush=True)

    def use(way: str) -> None:
        runner.bounded_head = bounded if way == WAYS[0] else None

    llm.generate(["warm up"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for batch in batches:
        bounded.calls = bounded.whole_head = bounded.tiles_read = 0
        times = decode_steps(llm, WAYS, use, batch, args.steps)
        served = bounded.calls - bounded.whole_head
        tile_mb = bounded.tiles_read * runner.model.lm_head.weight_bytes() / (-(-bounded.vocab // 16)) / 1e6
        print(ratio_line(f"decode batch {batch}, median step of {len(times[WAYS[0]])}", times, 1e3, "ms"), flush=True)
        print(f"    bounded calls {bounded.calls}: whole head {bounded.whole_head}; candidate tiles "
              f"{bounded.tiles_read / max(1, served):.0f} a call ({tile_mb / max(1, served):.2f} MB)", flush=True)
    runner.bounded_head = bounded


if __name__ == "__main__":
    main()
