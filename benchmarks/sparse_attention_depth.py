"""DeepSeek Sparse Attention's cost against dense MLA at depth: one decode step of one attention layer of
DeepSeek-V3.2's attention shape (heads, kv_lora_rank, rope, nope, v and the indexer's 64 heads of 128 as
published; hidden size scaled down, which only the projections feel) over a pool of `depth` keys, dense
(every key attended) and sparse (the indexer scores every key, attention reads the top 2048). Random
weights and pool: the times are what count. Both run in this process, alternating for --rounds rounds; each
figure is the best round's median of --repeats steps (the least disturbed by other work on the machine).

    flock /tmp/sudu-bench.lock python -m benchmarks.sparse_attention_depth [--depths 2048,8192,32768]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from sudu.layers.attention import build_metadata
from sudu.layers.kv_cache import KVCache
from sudu.layers.mla import LatentAttention
from sudu.layers.rotary import RotaryEmbedding
from sudu.model_config import ModelConfig

SHAPE = dict(architecture="deepseek2", vocab_size=1, hidden_size=1024, intermediate_size=1, num_hidden_layers=1,
             num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64)
SPARSE = dict(index_n_heads=64, index_head_dim=128, index_topk=2048)


def layer_and_pool(cfg: ModelConfig, depth: int):
    torch.manual_seed(0)
    layer = LatentAttention(cfg, 0).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    heads, k_dim, v_dim = cfg.kv_cache_shape()
    pool = KVCache(depth + 1, heads, k_dim, torch.float32, v_head_dim=v_dim)
    pool.k.normal_()
    pool.v.normal_()
    return layer, pool


def step_s(layer, pool, depth: int, rotary, repeats: int) -> float:
    x = torch.randn(1, SHAPE["hidden_size"])
    cos, sin = rotary.lookup(torch.tensor([depth]), torch.float32)
    times = []
    for _ in range(repeats):
        meta = build_metadata([1], [torch.arange(depth + 1)], [pool], None)
        t0 = time.perf_counter()
        with torch.inference_mode():
            layer(x, cos, sin, meta)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dense_cfg = ModelConfig(**SHAPE)
    sparse_cfg = dataclasses.replace(dense_cfg, **SPARSE)
    print(f"one decode step of one V3.2-shaped MLA layer, {args.threads} threads, best of {args.rounds} rounds' "
          f"medians of {args.repeats}")
    print(f"{'depth':>7} {'dense ms':>9} {'sparse ms':>10} {'sparse/dense':>13}")
    for depth in (int(d) for d in args.depths.split(",")):
        rotary = RotaryEmbedding(64, 10000.0, depth + 1)
        dense, dense_pool = layer_and_pool(dense_cfg, depth)
        sparse, sparse_pool = layer_and_pool(sparse_cfg, depth)
        step_s(dense, dense_pool, depth, rotary, 1)  # warm-up: first-call costs stay out of the figures
        step_s(sparse, sparse_pool, depth, rotary, 1)
        d_times, s_times = [], []
        for _ in range(args.rounds):  # alternate: drift falls on both alike
            d_times.append(step_s(dense, dense_pool, depth, rotary, args.repeats))
            s_times.append(step_s(sparse, sparse_pool, depth, rotary, args.repeats))
        d, s = min(d_times), min(s_times)
        print(f"{depth:>7} {d * 1e3:>9.1f} {s * 1e3:>10.1f} {s / d:>12.2f}x", flush=True)


if __name__ == "__main__":
    main()
