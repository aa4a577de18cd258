"""RMSNorm in the two conventions sudu's architectures use: `x * w` (llama, qwen2) and `x * (1 + w)` (gemma).

float32 rows of the `x * w` kind go through the native kernel (kernels/ops.cpp) when it is available: one
pass instead of F.rms_norm's five CPU kernels, and `add_forward` folds the residual add before the norm
into the same pass."""
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

    def _native(self, x: torch.Tensor) -> bool:
        return (self._ext is not None and not self.unit_offset and x.is_cpu and x.dtype == torch.float32
                and x.dim() == 2 and self.weight.dtype == torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            return self._ext.rms_norm(x.contiguous(), self.weight, self.eps)
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
        if self._native(x):
            return self._ext.add_rms_norm(x.contiguous(), delta.contiguous(), self.weight, self.eps)
        s = x + delta
        return s, self(s)
