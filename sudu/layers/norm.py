"""RMSNorm in the two conventions sudu's architectures use: `x * w` (llama, qwen2) and `x * (1 + w)` (gemma).

float32 rows go through the native kernel (kernels/ops.cpp) when it is available: one pass instead of
F.rms_norm's five CPU kernels (gemma's `1 + w` is formed once, in float32 as the reference forms it, and
kept until the weight changes), and `add_forward` folds the residual add before the norm into the same
pass. gemma calls a norm six times per layer, so its decode steps gain the most."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sudu import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        # gemma stores w with the unit added at run time; init keeps a fresh layer an identity either way
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self._ext = kernels.load()
        self._scale: tuple[tuple, torch.Tensor] | None = None  # (weight's identity and version, 1 + w)

    def _native(self, x: torch.Tensor) -> bool:
        return (self._ext is not None and x.is_cpu and x.dtype == torch.float32 and x.dim() >= 2
                and self.weight.dtype == torch.float32)

    def _native_weight(self) -> torch.Tensor:
        """What the kernel multiplies by: w, or gemma's 1 + w (rebuilt when the weight is loaded or changed)."""
        w = self.weight
        if not self.unit_offset:
            return w
        key = (w.data_ptr(), w._version)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, (1.0 + w.detach()).contiguous())
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return self._ext.rms_norm(rows, self._native_weight(), self.eps).view(x.shape)
        if not self.unit_offset and x.dtype == torch.float32:  # one fused op: same numbers, fewer dispatches
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual stream after a sublayer and the next sublayer's input."""
        if self._native(x) and x.dim() == 2:
            return self._ext.add_rms_norm(x.contiguous(), delta.contiguous(), self._native_weight(), self.eps)
        s = x + delta
        return s, self(s)
