"""One layer's KV pool: [num_slots, num_kv_heads, head_dim], stored as the model dtype or as int8 with a
float16 scale per (slot, head).

int8 halves the bytes of a bf16 pool (a quarter of fp32) at the cost of the scales (2 bytes per 64- or
128-wide head vector, 2-3%). Each new token's K and V are quantized symmetrically per head when written
(scale = max|x| / 127), so one token's outlier never degrades another's precision; attention reads the
gathered slots back as the compute dtype.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8")


class KVCache:
    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.index_copy_(0, slots, k.to(self.k.dtype))
        self.v.index_copy_(0, slots, v.to(self.v.dtype))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots (any shape S): [*S, num_kv_heads, head_dim] in dtype."""
        flat = slots.reshape(-1)
        k = self.k.index_select(0, flat).to(dtype)
        v = self.v.index_select(0, flat).to(dtype)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])


class Int8KVCache(KVCache):
    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int):
        super().__init__(num_slots, num_kv_heads, head_dim, torch.int8)
        self.k_scale = torch.zeros(num_slots, num_kv_heads, 1, dtype=torch.float16)
        self.v_scale = torch.zeros(num_slots, num_kv_heads, 1, dtype=torch.float16)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.int8) -> int:
        return 2 * num_kv_heads * (head_dim + 2)

    @staticmethod
    def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float()
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-8).to(torch.float16)
        q = torch.round(x / scale.float()).clamp_(-127, 127).to(torch.int8)
        return q, scale

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kq, ks = self._quantize(k)
        vq, vs = self._quantize(v)
        self.k.index_copy_(0, slots, kq)
        self.v.index_copy_(0, slots, vq)
        self.k_scale.index_copy_(0, slots, ks)
        self.v_scale.index_copy_(0, slots, vs)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        flat = slots.reshape(-1)
        k = self.k.index_select(0, flat).to(dtype) * self.k_scale.index_select(0, flat).to(dtype)
        v = self.v.index_select(0, flat).to(dtype) * self.v_scale.index_select(0, flat).to(dtype)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])


def make_kv_cache(kind: str, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVCache:
    if kind == "int8":
        return Int8KVCache(num_slots, num_kv_heads, head_dim)
    return KVCache(num_slots, num_kv_heads, head_dim, dtype)


def layer_kv_bytes_per_token(kind: str, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K and V take in one layer."""
    cls = Int8KVCache if kind == "int8" else KVCache
    return cls.bytes_per_token(num_kv_heads, head_dim, dtype)
