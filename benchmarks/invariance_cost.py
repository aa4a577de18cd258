"""The price of exactness: decode, 512-token prompt and 32-stream throughput of engines built side by side in
one process, measured in alternating rounds (docs/exactness.md has the figures).

    flock /tmp/sudu-bench.lock python -m benchmarks.invariance_cost                  # default vs --fast-math
    flock /tmp/sudu-bench.lock python -m benchmarks.invariance_cost --modes default  # one engine (to compare
                                                                                     # two source trees run by turns)
    flock /tmp/sudu-bench.lock python -m benchmarks.invariance_cost --modes default,vnni,fast --prompts 512,2048 \
        --prompts-only                                 # prompts with AMX tiles, without them, and --fast-math
Every prompt is salted (cold: nothing cached), greedy, ignore_eos, n-gram speculation off so that decode
speed is the model's. Prints per mode the median of the rounds and, with two modes, each ratio to the first.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time

from sudu import kernels
from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams

WORDS = ("cache block token prompt kernel thread memory vector model batch stream layer tile query key value "
         "server client request answer").split()


def salted_prompt(tok, n: int, rng: random.Random) -> list[int]:
    ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(n)))
    while len(ids) < n:
        ids += ids
    return ids[:n]


def round_of(llm: LLM, rng: random.Random, prompts: list[int], prompts_only: bool) -> dict[str, float]:
    tok = llm.tokenizer
    out = {}
    if not prompts_only:
        p = salted_prompt(tok, 16, rng)
        r = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))[0]
        out["decode_tok_per_s"] = (len(r.token_ids) - 1) / r.metrics.decode_s
    for n in prompts:  # the time to the first token of a cold prompt, as tokens per second
        p = salted_prompt(tok, n, rng)
        t = time.perf_counter()
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1))
        out[f"prompt{n}_tok_per_s"] = n / (time.perf_counter() - t)
    if prompts_only:
        return out
    ps = [salted_prompt(tok, 48, rng) for _ in range(32)]
    t = time.perf_counter()
    rs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    out["streams32_tok_per_s"] = sum(len(r.token_ids) for r in rs) / (time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--modes", default="default,fast",
                    help="default (invariant), vnni (invariant without AMX tiles: the same bits), f32attn (invariant, "
                         "attention in float32: --attention-arithmetic float32) and/or fast (--fast-math)")
    ap.add_argument("--prompts", default="512", help="prompt lengths whose cold time to first token is measured")
    ap.add_argument("--prompts-only", action="store_true", help="only the prompts (no decode, no 32 streams)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line per mode instead of the table")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    common = dict(progress=False, speculative="none", enable_prefix_caching=False, num_threads=args.threads)
    if args.model:
        common["model"] = args.model
    extra = {"fast": {"fast_math": True}, "f32attn": {"attention_arithmetic": "float32"}}
    engines = {m: LLM(**common, **extra.get(m, {})) for m in modes}
    prompts = [int(n) for n in args.prompts.split(",")]
    rng = random.Random(0)

    def run(m: str) -> dict[str, float]:
        # vnni: the kernels without AMX tiles (kernels.h KernelOptions.amx), every output the same
        with kernels.options(amx=False) if m == "vnni" else contextlib.nullcontext():
            return round_of(engines[m], rng, prompts, args.prompts_only)

    for m in modes:  # warm-up
        run(m)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for i in range(args.rounds):
        for m in (modes if i % 2 == 0 else modes[::-1]):
            results[m].append(run(m))
            print(f"round {i + 1} {m}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[m][-1].items()), flush=True)
    medians = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    if args.json:
        for m, v in medians.items():
            print(json.dumps({"mode": m, **v}))
        return
    first = modes[0]
    print(f"\nmedian of {args.rounds} rounds (tok/s)" + ("; ratio to " + first if len(modes) > 1 else ""))
    for k in medians[first]:
        line = f"  {k:22s} " + "  ".join(f"{m} {medians[m][k]:8.1f}" for m in modes)
        for m in modes[1:]:
            line += f"  {m}/{first} {medians[m][k] / medians[first][k]:.3f}"
        print(line)


if __name__ == "__main__":
    main()
