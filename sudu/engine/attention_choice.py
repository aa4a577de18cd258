"""Attention's arithmetic on the CPU: float32 (kernels/attention.cpp) or AMX's bfloat16 tiles
(kernels/attention_tiles.cpp).

Both are one recipe for every query row, whatever the call (decode, speculative verification, prompt chunk),
so either keeps a request's answer independent of what shares its step and of how its prompt was chunked or
cached (docs/exactness.md). They differ from each other in the numbers: the tiles round queries, keys,
weights and values to bfloat16 and sum in float32, as GPU attention kernels do; float32 rounds nothing but
the pool's own format. The choice is made once, for the whole model, at load; the startup line says which.
The tiles' sums are not a chain of fused multiply-adds (docs/exactness.md), so a CPU without AMX cannot
reproduce them: there attention runs in float32, and replicas on mixed machines agree only in float32.
"""
from __future__ import annotations

import torch

from sudu import kernels
from sudu.errors import SuduError
from sudu.layers.kv_cache import KVCache


def tiles_unavailable(device: torch.device, k_dim: int, v_dim: int) -> str | None:
    """Why the bfloat16 tiles cannot take this model's attention, or None when they can."""
    if device.type != "cpu":
        return f"attention runs on {device.type}, not the CPU"
    # the model's shape first: the same reason on every machine
    if k_dim != v_dim or k_dim % 32:
        return f"the head size ({k_dim} for K, {v_dim} for V) is not one multiple of 32"
    ext = kernels.load()
    if ext is None:
        return "the native kernels are not loaded"
    if not ext.bf16_tiles_granted():
        return "this CPU has no AMX bfloat16 tiles (or the OS does not grant them)"
    return None


def resolve(requested: str, device: torch.device, pool_dtype: torch.dtype, k_dim: int, v_dim: int) -> str:
    """float32 or bfloat16 for attention_arithmetic `requested` on the CPU (auto: bfloat16 where the tiles can
    take it and the pool is not float32); elsewhere the device kernels' own. An explicit bfloat16 the machine
    cannot run is an error."""
    if device.type != "cpu" and requested != "bfloat16":
        return f"the {device.type} kernels'"  # the Triton kernels' own arithmetic (cuda/paged_attention.py)
    if requested == "float32":
        return "float32"
    why = tiles_unavailable(device, k_dim, v_dim)
    if requested == "bfloat16":
        if why:
            raise SuduError(f"--attention-arithmetic bfloat16: {why}; use auto or float32")
        return "bfloat16"
    return "bfloat16" if why is None and pool_dtype != torch.float32 else "float32"


def apply(caches: list[KVCache], arithmetic: str) -> None:
    """Every layer's pool attended with `arithmetic` (the native kernels read KVCache.bf16_tiles)."""
    for cache in caches:
        cache.bf16_tiles = arithmetic == "bfloat16"
