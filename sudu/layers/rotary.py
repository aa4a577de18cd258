"""Rotary position embedding (the rotate-half convention of Hugging Face checkpoints)."""
from __future__ import annotations

import torch

from sudu import kernels


class RotaryEmbedding:
    """cos/sin tables for one (head_dim, base, scaling) triple, computed once up to max_positions."""

    def __init__(self, head_dim: int, base: float, max_positions: int, scaling_factor: float | None = None):
        # explicit device: networks are built under torch.device("meta") before their weights load
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim))
        if scaling_factor:
            inv_freq = inv_freq / scaling_factor
        t = torch.arange(max_positions, dtype=torch.float32, device=cpu)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotate_heads_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads_total, head_dim]; the first `heads` heads rotated (in place with the native kernel,
    kernels/ops.cpp, for float32; else by apply_rotary). Returns x."""
    ext = kernels.load()
    if ext is not None and x.is_cpu and x.dtype == torch.float32 and cos.dtype == torch.float32 \
            and x.stride(1) == x.shape[2] and x.stride(2) == 1:
        ext.rotary_(x, cos.contiguous(), sin.contiguous(), heads)
        return x
    x[:, :heads] = apply_rotary(x[:, :heads], cos, sin)
    return x
