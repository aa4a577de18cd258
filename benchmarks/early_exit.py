"""Would a self-speculative drafter pay on the 1.5B? An offline estimate (issue: Speculative decoding).

A self-speculative drafter runs the target's first L layers, its final norm and its output head (no
second model, the target's own KV for those layers). Its acceptance is how often that early exit's greedy
token equals the full model's. This measures it by teacher forcing over the greedy completions of the
speculative benchmark's two workloads, and prices a draft step by bytes read (L / n of the layers plus the
whole head, over a full step: decode is bandwidth-bound), with the verification cost measured by
benchmarks/speculative.py (--verify-cost). Expected speedup with k drafts:
(1 - a^(k+1)) / (1 - a) tokens per (k x draft cost + verify cost).

    python -m benchmarks.early_exit [--exits 4,7,10,14,18,21,24] [--verify-cost 1.91]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.speculative import LARGE, WORKLOADS, greedy
from sudu.engine.llm import LLM
from sudu.layers.attention import build_metadata
from sudu.layers.linear import QuantizedLinear


@torch.inference_mode()
def exit_predictions(llm: LLM, ids: list[int], rows: slice, exits: list[int]) -> dict[int, torch.Tensor]:
    """Greedy tokens at `rows` of one teacher-forced pass, per exit layer (and the full model's, at n)."""
    runner = llm.engine.runner
    model = runner.model
    n = len(model.model.layers)
    meta = build_metadata([len(ids)], [torch.arange(len(ids))], runner.kv_caches, runner.sliding_window)
    x = model.model.embed_tokens(torch.tensor(ids))
    cos, sin = model.rotary.lookup(torch.arange(len(ids)), x.dtype)
    residual, out = None, {}
    for i, layer in enumerate(model.model.layers):
        x, residual = layer(x, residual, cos, sin, meta)
        if i + 1 in exits or i + 1 == n:
            out[i + 1] = model.compute_logits(model.model.norm.add_forward(residual, x)[1][rows]).argmax(-1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exits", default="4,7,10,14,18,21,24")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--verify-cost", type=float, default=1.91, help="k+1 tokens' forward / one token's")
    args = ap.parse_args()
    torch.set_num_threads(2)
    exits = [int(e) for e in args.exits.split(",")]
    llm = LLM(LARGE, progress=False, kv_cache_memory=256 << 20)
    model = llm.engine.runner.model
    n = len(model.model.layers)
    hits = {L: 0 for L in exits}
    total = 0
    print(f"| workload | {' | '.join(f'exit {L}/{n}' for L in exits)} |\n|---|{'---|' * len(exits)}")
    for wl, texts in WORKLOADS.items():
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": texts[0]}])  # the first of each workload
        completion = llm.generate([prompt], greedy(args.tokens))[0].token_ids
        pred = exit_predictions(llm, prompt + completion, slice(len(prompt) - 1, len(prompt) + len(completion) - 1), exits)
        target = torch.tensor(completion)
        assert bool((pred[n] == target).float().mean() > 0.98)  # the pass reproduces the greedy completion
        same = {L: int((pred[L] == target).sum()) for L in exits}
        print(f"| {wl} | {' | '.join(f'{same[L] / len(completion):.3f}' for L in exits)} |", flush=True)
        for L in exits:
            hits[L] += same[L]
        total += len(completion)
    layer_bytes = sum(m.weight_bytes() for m in model.model.layers.modules() if isinstance(m, QuantizedLinear))
    head_bytes = model.lm_head.weight_bytes()
    print(f"\n| exit | acceptance (both) | draft step / target step | expected speedup, k={args.k} |\n|---|---|---|---|")
    for L in exits:
        a = hits[L] / total
        c = (L / n * layer_bytes + head_bytes) / (layer_bytes + head_bytes)
        tokens = (1 - a ** (args.k + 1)) / (1 - a) if a < 1 else args.k + 1
        print(f"| {L}/{n} | {a:.3f} | {c:.2f} | {tokens / (args.k * c + args.verify_cost):.2f}x |")


if __name__ == "__main__":
    main()
