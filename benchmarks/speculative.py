"""Speculative decoding, side by side in one run (issue: Speculative decoding).

Single-stream greedy decode tok/s with and without each drafter on two workloads:
  edit: rewrite a given function with a small change (3 prompts; the answer mostly copies the prompt: n-gram's
        home)
  gen:  free code generation (4 prompts)
Each workload's figures aggregate over its prompts (total tokens over total decode time).
  - n-gram lookup on the default model (qwen2.5-coder-0.5b-instruct)
  - draft model qwen2.5-coder-0.5b-instruct for target qwen2.5-coder-1.5b-instruct
Outputs must be identical to plain decoding (checked). Prints acceptance, tokens per verification
step, and the cost arithmetic: draft step / target step, verify cost of k+1 tokens / 1 token, and the
expected speedup they imply. Then the batch size at which n-gram speculation stops paying (aggregate
tok/s of B concurrent edit streams, on vs off).

    python -m benchmarks.speculative [--parts ngram,draft,batch] [--tokens 160]
"""
from __future__ import annotations

import argparse
import time

import torch

from sudu.engine.llm import LLM
from sudu.engine.scheduler import ScheduledSeq
from sudu.engine.sequence import Sequence
from sudu.sampling import SamplingParams

SMALL, LARGE = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"

FUNCTION = '''def summarize_orders(orders, min_total=0.0):
    """Group orders by customer and return totals above a threshold."""
    totals = {}
    counts = {}
    for order in orders:
        customer = order["customer"]
        amount = float(order["amount"])
        if amount < 0:
            raise ValueError(f"negative amount in order {order['id']}")
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    result = []
    for customer, total in sorted(totals.items()):
        if total >= min_total:
            average = total / counts[customer]
            result.append({"customer": customer, "total": round(total, 2),
                           "orders": counts[customer], "average": round(average, 2)})
    return result
'''
EDITS = [  # small changes: the answer is mostly the function again
    "Rename the parameter `min_total` to `threshold` everywhere",
    "Round the totals and averages to 3 decimal places instead of 2",
    "Also skip orders whose amount is zero (a check next to the negative-amount one)",
]
# several prompts per workload: one prompt's text decides its acceptance (a near-tie early in the answer can
# send it elsewhere), so each figure aggregates over all of them
WORKLOADS = {
    "edit": ["Here is a Python function:\n\n```python\n" + FUNCTION + f"```\n\n{edit} and return the complete "
             "updated function in one code block, nothing else." for edit in EDITS],
    "gen": [
        "Write a Python class LRUCache with get and put methods, O(1) operations, and docstrings.",
        "Write a Python function that parses a CSV file into a list of dicts, with docstrings and error handling.",
        "Implement a thread-safe bounded queue class in Python with put and get methods that take timeouts.",
        "Write a Python command-line tool with argparse that counts word frequencies in the files it is given.",
    ],
}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def decode_run(llm: LLM, prompt: list[int], n: int):
    """(decode tok/s from the first token to the last, TTFT in s, result). The draft model's prompt is
    computed in the target's prompt step, so it shows in TTFT, not in decode tok/s."""
    r = llm.generate([prompt], greedy(n))[0]
    m = r.metrics
    return (n - 1) / (m.finished_time - m.first_token_time), m.first_token_time - m.arrival_time, r


def forward_cost_s(runner, block_manager, ctx: int, new_tokens: int, repeat: int = 5) -> float:
    """Median time of one forward over new_tokens tokens after ctx cached ones, with logits for all of
    them (as verification computes them)."""
    # the context and the last token; the other new tokens ride as drafts (one logits row each)
    seq = Sequence("cost", 0, list(range(1000, 1000 + ctx + 1)), ctx, greedy(1), 0, 0.0, ctx + new_tokens + 1)
    block_manager.allocate(seq, ctx + new_tokens)
    seq.num_computed_tokens = ctx
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        runner.execute([ScheduledSeq(seq, new_tokens, list(range(2000, 2000 + new_tokens - 1)))])
        times.append(time.perf_counter() - t0)
    seq.num_computed_tokens = 0
    block_manager.free_sequence(seq)
    return sorted(times)[len(times) // 2]


def compare(name: str, plain: LLM, spec: LLM, prompts: dict, n: int, k: int, draft: bool = False) -> None:
    """Per workload, over all its prompts (plain and speculative alternating per prompt): decode tok/s as
    total tokens over total decode time, the speedup of those, the range of per-prompt speedups, and
    acceptance and tokens per verification over all verifications."""
    print(f"\n## {name}\n\n| workload | prompts | plain tok/s | speculative tok/s | speedup | per-prompt speedups "
          f"| acceptance | tokens/verify | TTFT plain / speculative (s) | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for llm in (plain, spec):  # warm-up: first-touch of the weights and kernels stays out of the figures
        llm.generate([ps[0] for ps in prompts.values()], greedy(8))
    for wl, ps in prompts.items():
        times = [0.0, 0.0]
        ttfts = [0.0, 0.0]
        ratios, same = [], True
        drafted = accepted = steps = 0
        for prompt in ps:
            p_tps, p_ttft, p_r = decode_run(plain, prompt, n)
            s_tps, s_ttft, s_r = decode_run(spec, prompt, n)
            times[0] += (n - 1) / p_tps
            times[1] += (n - 1) / s_tps
            ttfts[0] += p_ttft / len(ps)
            ttfts[1] += s_ttft / len(ps)
            ratios.append(s_tps / p_tps)
            same &= s_r.token_ids == p_r.token_ids
            m = s_r.metrics
            drafted += m.num_draft_tokens
            accepted += m.num_accepted_tokens
            steps += m.num_spec_steps
        p_tps, s_tps = len(ps) * (n - 1) / times[0], len(ps) * (n - 1) / times[1]
        acc = accepted / drafted if drafted else 0.0
        per_verify = (accepted + steps) / steps if steps else 1.0
        print(f"| {wl} | {len(ps)} | {p_tps:.2f} | {s_tps:.2f} | {s_tps / p_tps:.2f}x | "
              f"{min(ratios):.2f}-{max(ratios):.2f}x | {acc:.2f} | {per_verify:.2f} | {ttfts[0]:.2f} / {ttfts[1]:.2f} "
              f"| {same} |", flush=True)
    ctx = len(prompts["edit"][0]) + n // 2
    eng = plain.engine
    one = forward_cost_s(eng.runner, eng.block_manager, ctx, 1)
    many = forward_cost_s(eng.runner, eng.block_manager, ctx, k + 1)
    print(f"\ncost arithmetic: target forward 1 token {1000 * one:.0f} ms, {k + 1} tokens {1000 * many:.0f} ms "
          f"(verify cost {many / one:.2f}x a step)")
    if draft:
        drafter = spec.engine.drafter  # the draft model as the drafter runs it (its own head)
        d_one = forward_cost_s(drafter.runner, drafter.block_manager, ctx, 1)
        c = d_one / one
        print(f"draft step {1000 * d_one:.0f} ms = {c:.2f} of a target step; with acceptance a and k={k} drafts, "
              f"tokens per step = (1 - a^(k+1)) / (1 - a), cost per step = {k} x {c:.2f} + {many / one:.2f} "
              f"target steps")
        for a in (0.6, 0.8, 0.9):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            print(f"  a={a}: expected speedup {tokens / (k * c + many / one):.2f}x")


def batch_switch(model: str, prompt_ids: list[int], n: int, sizes: list[int], quantization: str) -> None:
    print("\n## batch size vs n-gram speculation (edit workload, aggregate output tok/s)\n")
    print("| concurrent streams | plain | n-gram | ratio |\n|---|---|---|---|")
    plain = LLM(model, speculative="none", progress=False, quantization=quantization)
    spec = LLM(model, progress=False, quantization=quantization, speculative="ngram", speculative_max_batch=10 ** 6)
    for b in sizes:
        rates = []
        for llm in (plain, spec):
            t0 = time.perf_counter()
            llm.generate([prompt_ids] * b, greedy(n))
            rates.append(b * n / (time.perf_counter() - t0))
        print(f"| {b} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[1] / rates[0]:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="ngram,draft,batch")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=0, help="num_speculative_tokens (0: each drafter's default)")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(2)
    parts = args.parts.split(",")
    q = args.quantization
    small = LLM(SMALL, speculative="none", progress=False, quantization=q)
    prompts = {wl: [small.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]
               for wl, texts in WORKLOADS.items()}
    if "ngram" in parts:
        spec = LLM(SMALL, progress=False, quantization=q, speculative="ngram", num_speculative_tokens=args.k)
        compare(f"n-gram lookup, {SMALL}", small, spec, prompts, args.tokens, spec.engine.spec_controller.max_tokens)
        del spec
    if "draft" in parts:
        target = LLM(LARGE, speculative="none", progress=False, quantization=q)
        spec = LLM(LARGE, progress=False, quantization=q, speculative=f"draft:{SMALL}", num_speculative_tokens=args.k)
        compare(f"draft model {SMALL} -> {LARGE}", target, spec, prompts, args.tokens,
                spec.engine.spec_controller.max_tokens, draft=True)
        del target, spec
    if "batch" in parts:
        del small
        batch_switch(SMALL, prompts["edit"][0], args.tokens // 2, [int(b) for b in args.batch_sizes.split(",")], q)


if __name__ == "__main__":
    main()
