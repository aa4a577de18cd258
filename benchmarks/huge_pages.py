"""Weights in huge pages (host/huge_pages.py) against the same weights in ordinary 4 KiB pages, in one
process: the engine loads its weights into huge pages, this script makes a second copy of every moved
weight in ordinary memory, and the two copies take turns, step by step for decode (speculation off, so a
step is one token per sequence) and prompt by prompt for cold prompts. The first lines are the machine's ceiling:
a 2-thread sum over 1 GiB in each kind of page.

    flock /tmp/sudu-bench.lock python -m benchmarks.huge_pages [--model M] [--batch 1] [--rounds 6]
                                                               [--tokens 128] [--prompt-words 400]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from sudu.bench.workloads import CHAT_CODE_PROMPTS
from sudu.host import huge_pages
from sudu.engine.llm import LLM
from sudu.commands.roofline import measure_bandwidth_gbs
from sudu.sampling import SamplingParams


def ceiling(threads: int) -> str:
    plain, huge = (measure_bandwidth_gbs(threads=threads, huge_pages=h) for h in (False, True))
    return f"1 GiB sum, {threads} threads: 4 KiB pages {plain:.1f} GB/s, huge pages {huge:.1f} GB/s"


def weight_slots(model: torch.nn.Module) -> list:
    """(module, kind, name) of every parameter and buffer that lives in the huge-page mapping."""
    holders = huge_pages.storage_holders(model, 0)[model.huge_page_weights.untyped_storage().data_ptr()][1]
    return [(module, kind, name) for module, kind, name, _, _ in holders]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per generation")
    ap.add_argument("--prompt-words", type=int, default=400, help="words of each cold prompt (0: no prompt part)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if huge_pages.huge_page_size() is None:
        raise SystemExit("huge_pages: transparent huge pages are off or unknown here (nothing to compare)")
    torch.set_num_threads(args.threads)
    print(ceiling(args.threads), flush=True)
    llm = LLM(args.model, speculative="none", progress=False, num_threads=args.threads)
    net = llm.engine.runner.model
    if getattr(net, "huge_page_weights", None) is None:
        raise SystemExit("huge_pages: the engine moved no weights into huge pages")
    slots = weight_slots(net)
    copies = {"huge": {}, "4K": {}}
    for module, kind, name in slots:
        t = getattr(module, name)
        copies["huge"][(id(module), name)] = t.detach() if kind == "parameter" else t
        copies["4K"][(id(module), name)] = t.detach().clone()
    print(f"{args.model}: {len(slots)} weights, {huge_pages.huge_page_bytes(net.huge_page_weights) / 2**20:.0f} MiB "
          f"of them in huge pages", flush=True)

    def use(which: str) -> None:
        for module, kind, name in slots:
            huge_pages.point_at(module, kind, name, copies[which][(id(module), name)])
        if hasattr(net, "prepare_native_decode"):
            net.prepare_native_decode()

    eng, step = llm.engine, llm.engine.step
    turn, steps = [0], {"huge": [], "4K": []}

    def alternating_step(*a, **kw):
        """Each step on the other copy: step-by-step pairs, which the VM's drift over seconds does not move."""
        which = ("huge", "4K")[turn[0] % 2]
        turn[0] += 1
        use(which)
        t0 = time.perf_counter()
        out = step(*a, **kw)
        steps[which].append(time.perf_counter() - t0)
        return out

    decode = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(["warm up"] * args.batch, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    vocab = " ".join(CHAT_CODE_PROMPTS).split()
    rng = random.Random(1)
    step_ratio, step_ms, prompt_ms = [], {"huge": [], "4K": []}, {"huge": [], "4K": []}
    for r in range(args.rounds):
        eng.step = alternating_step
        turn[0] = 0
        for v in steps.values():
            v.clear()
        prompts = [f"Write a Python function number {r}-{i} that checks whether a string is a palindrome."
                   for i in range(args.batch)]
        llm.generate(prompts, decode)
        eng.step = step
        pairs = list(zip(steps["huge"][1:], steps["4K"][1:]))  # the prompt's step (the first) left out
        step_ratio.append(statistics.median(h / p for h, p in pairs))
        for which, i in (("huge", 0), ("4K", 1)):
            step_ms[which].append(statistics.median(p[i] for p in pairs) * 1e3)
        line = (f"round {r + 1}: decode step huge {step_ms['huge'][-1]:.2f} ms, 4K {step_ms['4K'][-1]:.2f} ms "
                f"(step pairs' median ratio {step_ratio[-1]:.3f})")
        if args.prompt_words:  # cold prompts, each copy in turn
            for which in ("huge", "4K") if r % 2 == 0 else ("4K", "huge"):
                use(which)
                cold = f"[{rng.random()}] " + " ".join(rng.choice(vocab) for _ in range(args.prompt_words))
                t0 = time.perf_counter()
                llm.generate([cold], SamplingParams(max_tokens=1, temperature=0.0))
                prompt_ms[which].append((time.perf_counter() - t0) * 1e3)
            line += f"; cold prompt huge {prompt_ms['huge'][-1]:.0f} ms, 4K {prompt_ms['4K'][-1]:.0f} ms"
        print(line, flush=True)
    ratio = lambda d: statistics.median(a / b for a, b in zip(d["huge"], d["4K"]))  # noqa: E731
    print(f"\n{args.model}, batch {args.batch}: huge / 4K pages: decode step {statistics.median(step_ratio):.3f} "
          f"(median over rounds of the step pairs' median ratio; {statistics.median(step_ms['huge']):.2f} / "
          f"{statistics.median(step_ms['4K']):.2f} ms)"
          + (f", cold prompt {ratio(prompt_ms):.3f} (median of per-round ratios)" if args.prompt_words else ""))
    print(ceiling(args.threads))


if __name__ == "__main__":
    main()
