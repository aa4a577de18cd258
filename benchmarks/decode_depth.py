"""Decode attention at depth over one KV pool per layer, as the engine holds them: what a deep decode step's
attention costs when its keys and values come from memory, not from cache.

`benchmarks.attention_arithmetic --speed` times the kernels on one pool reused for every layer, small enough
at 24k keys to stay in the last-level cache. Here each of the model's layers has its own pool (the default
model's shapes: 2 kv heads of 64, float16, 14 query heads), filled with random keys in a fresh engine's
order (consecutive slots), and one step runs `decode_attention` layer after layer, so every step reads all the
pools from memory. Pools in 4 KiB pages (layers/kv_cache.py kv_pool, as the engine allocates them: each kv
head's rows together) and in 2 MiB transparent huge pages (host/huge_pages.py, where the OS offers them), and
with --slot-major also with a slot's heads together, alternate in one process, next to a plain read of the
same bytes (torch's sum over each pool, the bandwidth reference).

    flock /tmp/sudu-bench.lock python -m benchmarks.decode_depth [--depths 8192,24576,32768] [--rounds 3] [--slot-major]
"""
from __future__ import annotations

import argparse
import time
from functools import partial

import torch


def pools(layers: int, keys: int, kv_heads: int, head_dim: int, huge: bool,
          heads_apart: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V pools [keys, kv_heads, head_dim], float16: each head's rows together (the engine's
    CPU layout, layers/kv_cache.py kv_pool) or slot-major (heads_apart False: a slot's heads together)."""
    from sudu.host.huge_pages import huge_page_buffer, huge_page_size
    from sudu.layers.kv_cache import kv_pool, zeroed_pool

    out = []
    shape = (keys, kv_heads, head_dim)
    stored = (kv_heads, keys, head_dim) if heads_apart else shape
    nbytes = keys * kv_heads * head_dim * 2
    for _ in range(layers):
        kv = []
        for scale in (2.0, 1.0):
            if huge:
                t = huge_page_buffer(nbytes, huge_page_size()).view(torch.float16).view(stored)
                t = t.permute(1, 0, 2) if heads_apart else t
            else:
                t = kv_pool(*shape, torch.float16) if heads_apart else zeroed_pool(shape, torch.float16)
            t.copy_((torch.randn(shape) * scale).half())
            kv.append(t)
        out.append((kv[0], kv[1]))
    return out


def median_s(f, n: int) -> float:
    """The median time of n calls of f, in seconds."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2]


def attend_all(ext, layer_pools, q, out, slots, mask, rows, tiles: bool) -> None:
    """One decode step's attention: each layer's pool in turn."""
    from sudu.layers.attention import NO_SCALES

    for k, v in layer_pools:
        ext.decode_attention(q, k, v, NO_SCALES, NO_SCALES, rows, slots, mask, q.shape[-1] ** -0.5, out, tiles)


def read_all(layer_pools) -> None:
    """A plain read of the same bytes (the bandwidth reference)."""
    for k, v in layer_pools:
        k.sum()
        v.sum()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="8192,24576,32768")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=9, help="steps per round (median)")
    ap.add_argument("--slot-major", action="store_true",
                    help="also pools with a slot's heads together (the layout before kv_pool kept each head's rows "
                         "together)")
    args = ap.parse_args()
    from sudu import kernels
    from sudu.host.huge_pages import huge_page_size

    ext = kernels.load()
    if ext is None:
        raise SystemExit("decode_depth: the native kernels did not load")
    tiles = bool(ext.bf16_tiles_granted())
    kinds = ["4k"] + (["huge"] if huge_page_size() else [])
    kinds += [f"{kind}, slot-major" for kind in kinds] if args.slot_major else []
    print(f"decode attention over {args.layers} pools ({args.kv_heads} kv heads x {args.head_dim}, float16), "
          f"{args.heads} query heads, {torch.get_num_threads()} threads, "
          f"{'bfloat16 tiles' if tiles else 'float32'} arithmetic; median of {args.steps} steps, best of "
          f"{args.rounds} alternating rounds")
    print("| depth | pages | KV MB a step | attention ms | KV GB/s | plain read ms | attention / read |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for L in (int(d) for d in args.depths.split(",")):
        q = torch.randn(1, args.heads, args.head_dim)
        out = torch.empty_like(q)
        slots = torch.arange(L)[None]
        mask = torch.ones(1, 1, L, dtype=torch.bool)
        rows = torch.zeros(1, 1, dtype=torch.long)
        held = {kind: pools(args.layers, L, args.kv_heads, args.head_dim, kind.startswith("huge"),
                            "slot-major" not in kind) for kind in kinds}
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.rounds):
            for kind in kinds:
                a = median_s(partial(attend_all, ext, held[kind], q, out, slots, mask, rows, tiles), args.steps)
                r = median_s(partial(read_all, held[kind]), args.steps)
                prev = best.get(kind, (a, r))
                best[kind] = (min(a, prev[0]), min(r, prev[1]))
        mb = args.layers * 2 * L * args.kv_heads * args.head_dim * 2 / 1e6
        for kind in kinds:
            a, r = best[kind]
            print(f"| {L} | {kind} | {mb:.0f} | {a * 1e3:.1f} | {mb / 1e3 / a:.1f} | {r * 1e3:.1f} | {a / r:.2f} |",
                  flush=True)
        del held


if __name__ == "__main__":
    main()
