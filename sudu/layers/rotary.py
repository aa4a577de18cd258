"""Rotary position embedding (the rotate-half convention of Hugging Face checkpoints), with the frequency
scalings that extend a model's context: linear (positions divided by the factor), YaRN and Llama 3's
(both: low frequencies interpolated, high ones kept, a ramp between). NTK "dynamic" scaling is not here:
its frequencies change with the sequence's current length, so a cached token's K would depend on how
long its sequence later grew."""
from __future__ import annotations

import math

from typing import TYPE_CHECKING

import torch

from sudu import kernels

if TYPE_CHECKING:
    from sudu.model_config import ModelConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context extended `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, base: float, yarn: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than beta_slow times over the original context
    are interpolated (frequency / factor), those that turn more than beta_fast times kept, a linear ramp
    between; cos/sin are scaled by the attention factor. Returns (inv_freq, attention factor)."""
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if yarn.get("truncate", True):  # whole dimensions (the paper's and DeepSeek's); gpt-oss keeps fractions
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / max(high - low, 0.001)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        if yarn.get("mscale") and yarn.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, yarn["mscale"]) / yarn_mscale(factor, yarn["mscale_all_dim"])
        else:
            attention_factor = yarn_mscale(factor)
    return inv_freq, attention_factor


def llama3_frequencies(inv_freq: torch.Tensor, llama3: dict) -> torch.Tensor:
    """Llama 3.1's scaling: a dimension whose wavelength is longer than original / low_freq_factor turns
    `factor` times slower, one shorter than original / high_freq_factor is kept, and in between the two
    are mixed by where original / wavelength falls between the two factors."""
    factor, original = llama3["factor"], llama3["original_max_position_embeddings"]
    low, high = llama3.get("low_freq_factor", 1.0), llama3.get("high_freq_factor", 4.0)
    wavelength = 2 * math.pi / inv_freq
    mix = ((original / wavelength - low) / (high - low)).clamp(0, 1)
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    between = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(between, (1 - mix) * inv_freq / factor + mix * inv_freq, scaled)


class RotaryEmbedding:
    """cos/sin tables for one (head_dim, base, scaling) triple, computed once up to max_positions."""

    def __init__(self, head_dim: int, base: float, max_positions: int, scaling_factor: float | None = None,
                 yarn: dict | None = None, llama3: dict | None = None):
        # explicit device: networks are built under torch.device("meta") before their weights load
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim))
        if scaling_factor:
            inv_freq = inv_freq / scaling_factor
        attention_factor = 1.0
        if yarn:
            inv_freq, attention_factor = yarn_frequencies(inv_freq, head_dim, base, yarn)
        if llama3:
            inv_freq = llama3_frequencies(inv_freq, llama3)
        t = torch.arange(max_positions, dtype=torch.float32, device=cpu)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * attention_factor
        self.sin = emb.sin() * attention_factor

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary (Qwen2-VL family): a token has a (temporal, height, width) position triple, and the
    rotary channel pairs are split in `sections` consecutive runs, the i-th run turning with the (i mod 3)-th
    coordinate. A text token's three coordinates are equal, which makes it plain rotary."""

    def __init__(self, head_dim: int, base: float, max_positions: int, sections: list[int]):
        super().__init__(head_dim, base, max_positions)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {sections} must sum to head_dim / 2 = {head_dim // 2}")
        cpu = torch.device("cpu")
        self.axis = torch.tensor([i % 3 for i, n in enumerate(sections) for _ in range(n)], device=cpu)
        self.channels = torch.arange(head_dim // 2, device=cpu)

    def to(self, device: torch.device) -> MRotaryEmbedding:
        super().to(device)
        self.axis, self.channels = self.axis.to(device), self.channels.to(device)
        return self

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] coordinates, or [T] (text: the same position on all three). cos/sin [T, head_dim]."""
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        rows = positions[self.axis].T  # [T, head_dim / 2]: the coordinate each channel pair turns with
        cos, sin = self.cos[rows, self.channels], self.sin[rows, self.channels]
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def scaled_rotary(cfg: ModelConfig) -> RotaryEmbedding:
    """The rotary tables of a model's (global) attention layers with the config's scaling, up to its context."""
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling_factor,
                           cfg.rope_yarn, cfg.rope_llama3)


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
