"""The gated feed-forward block of llama-family and gemma networks: down(act(gate(x)) * up(x))."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sudu import kernels
from sudu.layers import linear
from sudu.layers.fuse import fuse_linears
from sudu.layers.linear import QuantizedLinear

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


# A long prompt chunk's MLP runs in row blocks whose float32 intermediate (silu(gate) * up from the fused
# call, else gate/up's output) stays within this many bytes: each block's intermediates then stay well under
# glibc's mmap threshold (32 MiB), above which every call's output is fresh memory that faults in page by
# page, and within L3 (docs/cpu_speed.md). Rows are independent, so the blocks give the rows of one call bit
# for bit.
BLOCK_BYTES = 14 << 20


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {hidden_act!r}")
        self.act = ACTIVATIONS[hidden_act]
        ext = kernels.load()
        # silu(gate) * up in one native pass (kernels/ops.cpp) for float32 rows
        self._silu_mul = ext.silu_mul if ext is not None and hidden_act == "silu" else None
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj = None  # set by fuse_projections
        # quantized gate_up and down: where prompt chunks run as bfloat16 GEMMs (--fast-math), gate_up's output
        # stays in bfloat16 through silu_mul into the down projection's GEMM (the values the float32 route
        # gives, without its float32 copies: layers/linear.py chunk_gemm)
        self._bf16_chunks = False

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj with one gate_up_proj (after the weights are loaded and quantized)."""
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj
            self._bf16_chunks = (self._silu_mul is not None
                                 and isinstance(fused, QuantizedLinear) and fused._ext is not None
                                 and isinstance(self.down_proj, QuantizedLinear) and self.down_proj._ext is not None)

    def _fuses_silu(self, x: torch.Tensor) -> bool:
        """Whether silu(gate) * up runs inside the quantized gate_up call (kernels/quant_linear.cpp
        qlinear_silu: the same values, without the [rows, 2I] intermediate and the pass over it): gate and up
        whole tiles each, and rows that take the integer kernel."""
        fused = self.gate_up_proj
        return (isinstance(fused, QuantizedLinear) and fused._ext is not None and fused.out_features % 32 == 0
                and x.shape[0] < linear.PREFILL_MIN_ROWS)

    def _gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x) for float32 rows: in the gate_up call where _fuses_silu, else silu_mul after it."""
        fused = self.gate_up_proj
        if self._fuses_silu(x):
            return fused._ext.qlinear_silu(x, fused.qweight, fused.bias)
        return self._silu_mul(fused(x))

    def forward(self, x):
        if self.gate_up_proj is not None:
            if (self._bf16_chunks and linear.PREFILL_DTYPE == torch.bfloat16 and x.dim() == 2
                    and x.dtype == torch.float32 and x.shape[0] >= linear.PREFILL_MIN_ROWS):
                gate_up = self.gate_up_proj.chunk_gemm(x, keep_gemm_dtype=True)
                return self.down_proj.chunk_gemm(self._silu_mul(gate_up))
            if self._silu_mul is not None and x.is_cpu and x.dtype == torch.float32 and x.dim() == 2:
                # blocks only where the whole call takes the integer kernel too (a GEMM route dequantizes the
                # weights per call)
                width = self.gate_up_proj.out_features // (2 if self._fuses_silu(x) else 1)
                rows = max(64, BLOCK_BYTES // (4 * width)) if BLOCK_BYTES else x.shape[0]
                if x.shape[0] <= rows or x.shape[0] >= linear.PREFILL_MIN_ROWS:
                    return self.down_proj(self._gate_up_silu(x))
                n = -(-x.shape[0] // rows)
                step = (-(-x.shape[0] // n) + 7) // 8 * 8  # n even blocks, whole 8-row kernel calls
                return torch.cat([self.down_proj(self._gate_up_silu(b)) for b in x.split(step)])
            gate_up = self.gate_up_proj(x)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
