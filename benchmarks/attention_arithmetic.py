"""The price of attention's bfloat16-tile arithmetic (`--attention-arithmetic`), in quality and in speed.

Quality: one teacher-forced pass over a long real text (the GFDL and GPL licence texts, then the source of
Python's argparse module: prose, then code) per variant, on each model. Every variant is compared with the
reference, a float32 KV pool attended in float32:
  * greedy agreement: the share of positions whose argmax equals the reference's, overall and by depth;
  * perplexity of the text, and its change from the reference.
Variants: float16 pool + float32 attention (the arithmetic before the tiles), float16 pool + bfloat16 tiles
(auto's choice on an AMX machine), and bfloat16 pool + bfloat16 tiles. The bars --kv-cache-dtype auto holds
int8 KV to (engine/kv_choice.py: >= 99% agreement, perplexity +0.5%) are printed beside them.

Speed (--speed): the native attention kernels alone with the model's head shapes, one 512-token prompt chunk
and one decode step at each depth, float32 and tiles alternating in one process.

    python -m benchmarks.attention_arithmetic [--models qwen2.5-coder-0.5b-instruct,...] [--tokens 8192] [--speed]
"""
from __future__ import annotations

import argparse
import math
import pathlib
import time

import torch

TEXTS = [pathlib.Path("/usr/share/common-licenses/GFDL-1.3"), pathlib.Path("/usr/share/common-licenses/GPL-3")]
AGREEMENT_BAR, PPL_BAR = 0.99, 0.005


def long_text() -> str:
    import argparse as module
    import inspect

    missing = [str(p) for p in TEXTS if not p.exists()]
    if missing:
        raise SystemExit(f"attention_arithmetic: the text files {', '.join(missing)} are missing")
    return "\n\n".join(p.read_text() for p in TEXTS) + "\n\n" + inspect.getsource(module)


def variant_scores(model, ids: list[int], pool_dtype: torch.dtype, tiles: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probabilities [n-1] and greedy tokens [n-1] of one pass with the given pool and
    arithmetic."""
    from sudu.engine.text_eval import next_token_scores
    from sudu.layers.kv_cache import KVCache

    cfg = model.config
    heads, k_dim, v_dim = cfg.kv_cache_shape()
    pools = [KVCache(len(ids), heads, k_dim, pool_dtype, v_head_dim=v_dim) for _ in range(cfg.num_hidden_layers)]
    for p in pools:
        p.bf16_tiles = tiles
    return next_token_scores(model, ids, pools, rows=256)


def quality(name: str, tokens: int) -> None:
    from sudu import LLM

    llm = LLM(name, speculative="none", greedy_head="full")
    model = llm.engine.runner.model
    ids = llm.tokenizer.encode(long_text())[:tokens]
    print(f"\n## {name}: {len(ids)} tokens of text, teacher-forced (reference: float32 pool, float32 attention)")
    t = time.perf_counter()
    ref_logp, ref_top = variant_scores(model, ids, torch.float32, False)
    ref_ppl = math.exp(-ref_logp.mean().item())
    print(f"reference perplexity {ref_ppl:.4f} ({time.perf_counter() - t:.0f} s)")
    bins = [(0, 2048), (2048, 8192), (8192, 1 << 30)]
    head = " | ".join(f"agree {a // 1024}k-{'end' if b > 1 << 29 else f'{b // 1024}k'}" for a, b in bins)
    print(f"| pool, attention | agreement | {head} | perplexity | change |")
    print("|---|---:|" + "---:|" * len(bins) + "---:|---:|")
    variants = (("float16, float32", torch.float16, False), ("float16, bfloat16 tiles", torch.float16, True),
                ("bfloat16, bfloat16 tiles", torch.bfloat16, True))
    for label, dtype, tiles in variants:
        logp, top = variant_scores(model, ids, dtype, tiles)
        same = (top == ref_top).float()
        by_depth = [f"{same[a:b].mean().item():.2%}" if same[a:b].numel() else "-" for a, b in bins]
        ppl = math.exp(-logp.mean().item())
        print(f"| {label} | {same.mean().item():.2%} | {' | '.join(by_depth)} | {ppl:.4f} | {ppl / ref_ppl - 1:+.3%} |")
    print(f"(the bars auto holds int8 KV to: agreement >= {AGREEMENT_BAR:.0%}, perplexity change <= +{PPL_BAR:.1%})")
    del llm


def speed(depths: list[int], heads: int, kv_heads: int, head_dim: int, layers: int) -> None:
    from benchmarks.decode_depth import median_s as median
    from sudu import kernels

    ext = kernels.load()
    none = torch.empty(0)
    print(f"\n## kernels alone: {heads} heads, {kv_heads} kv heads, head size {head_dim}, float16 pool, "
          f"{torch.get_num_threads()} threads; x{layers} layers")
    print("| depth | prompt chunk of 512, float32 | bfloat16 tiles | speedup | decode step, float32 | tiles "
          "| speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|")

    for L in depths:
        k = (torch.randn(L, kv_heads, head_dim) * 2).half()
        v = torch.randn(L, kv_heads, head_dim).half()
        slots = torch.arange(L)
        q = torch.randn(512, heads, head_dim)
        out = torch.empty_like(q)
        qd, od = torch.randn(1, heads, head_dim), torch.empty(1, heads, head_dim)
        rows, mask = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, L, dtype=torch.bool)
        res = {}
        for rnd in range(2):  # alternating rounds: a drift of the machine falls on both
            for tiles in (False, True):
                p = median(lambda: ext.prompt_attention(q, k, v, none, none, slots, out, L - 512, 0, head_dim ** -0.5,
                                                        tiles), 3)
                d = median(lambda: ext.decode_attention(qd, k, v, none, none, rows, slots[None], mask,
                                                        head_dim ** -0.5, od, tiles), 15)
                res[tiles] = (min(p, res.get(tiles, (p, d))[0]), min(d, res.get(tiles, (p, d))[1]))
        (pf, df), (pt, dt) = res[False], res[True]
        print(f"| {L} | {pf * layers * 1e3:.0f} ms | {pt * layers * 1e3:.0f} ms | {pf / pt:.2f}x | "
              f"{df * layers * 1e3:.1f} ms | {dt * layers * 1e3:.1f} ms | {df / dt:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the text (its first ones)")
    ap.add_argument("--speed", action="store_true", help="also time the kernels at depth (0.5B's head shapes)")
    ap.add_argument("--depths", default="2048,8192,24576,32768")
    args = ap.parse_args()
    from sudu import kernels

    ext = kernels.load()
    if ext is None or not ext.bf16_tiles_granted():
        raise SystemExit("attention_arithmetic: this CPU has no AMX bfloat16 tiles; nothing to compare")
    for name in args.models.split(","):
        quality(name, args.tokens)
    if args.speed:
        speed([int(d) for d in args.depths.split(",")], 14, 2, 64, 24)


if __name__ == "__main__":
    main()
