"""Weight-only int8 / int4 linear layers on the CUDA path: Triton kernels that multiply activations by the
CPU formats' row layout (layers/linear.py quantize_int8 / quantize_int4) as stored, and
`quantize_model_cuda`, which swaps a network's nn.Linear modules for them in place.

out[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), W dequantized tile by tile in registers (never as a float
copy in memory), products accumulated in float32, the output in x's dtype. Weights are dequantized in
float32 exactly as dequantize_torch does, then rounded to x's dtype for the tensor-core product (bfloat16 /
float16: the same rounding the CUDA path's float weights carry); float32 activations multiply in IEEE float32,
not TF32.

Batch invariance: the tiles (tile_config) depend on N and K only and the K loop is never split, so every
output row takes the same operations in the same order at any M. Greedy speculative decoding rests on that:
verifying k tokens in one call must give what k single-row calls give, bit for bit. BLOCK_K depends on K
only, so layers fused along N (fuse_linears) compute each column as the parts did.

Triton is imported when a kernel is first needed (`_kernels`), which also makes TRITON_INTERPRET=1 (Triton's
CPU interpreter, read when a kernel is defined) take effect if set before that first call.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from sudu.quant.formats import (
    FORMATS,
    GROUP_SIZE,
    q8_0_blocks,
    quantize_int4,
    quantize_int8,
)

log = logging.getLogger(__name__)

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows per tile. Fixed (batch invariance): 16 is tl.dot's minimum; 32 amortises each weight tile's
# dequantization over twice the prefill rows while a decode step's wasted tensor-core work stays well
# under the time its weight bytes take to arrive from memory.
BLOCK_M = 32
# Decode parallelism comes from N alone (no split-K): output tiles narrow enough that a layer spans about
# as many programs as an H100/H200 has SMs, wider (fewer re-reads of x) where N allows.
MIN_PROGRAMS_N = 128


def tile_config(n: int, k: int) -> dict[str, int]:
    """The kernels' tiles for an [N, K] weight; never a function of M (module docstring)."""
    block_n = next((b for b in (64, 32) if -(-n // b) >= MIN_PROGRAMS_N), 16)
    # a K tile that divides K (a multiple of 32): no masks in the K loop
    block_k = next(b for b in (128, 64, 32) if k % b == 0)
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def int8_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, M, N, K,
                    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * N can pass 2^31 (a prompt's logits)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm[:, None] < M, rn[:, None] < N
        groups = K // 32
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=m_ok, other=0.0)
            q = tl.load(q_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=n_ok, other=0)
            s = tl.load(s_ptr + rn[:, None] * groups + ((k0 + rk) // 32)[None, :], mask=n_ok, other=0.0)
            w = (q.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok & (rn[None, :] < N))

    @triton.jit
    def int4_kernel(x_ptr, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K,
                    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Byte c of a K tile holds column 32 * (c // 16) + c % 16 in its low nibble and that + 16 in its high
        # one: the low and the high nibbles each multiply the matching half of x's columns, no shuffles.
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * N can pass 2^31 (a prompt's logits)
        rc = tl.arange(0, BLOCK_K // 2)
        col_lo = (rc // 16) * 32 + rc % 16
        m_ok, n_ok = rm[:, None] < M, rn[:, None] < N
        groups = K // 32
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x_lo = tl.load(x_ptr + rm[:, None] * K + (k0 + col_lo)[None, :], mask=m_ok, other=0.0)
            x_hi = tl.load(x_ptr + rm[:, None] * K + (k0 + col_lo + 16)[None, :], mask=m_ok, other=0.0)
            p = tl.load(p_ptr + rn[:, None] * (K // 2) + (k0 // 2 + rc)[None, :], mask=n_ok, other=0)
            g = rn[:, None] * groups + (k0 // 32 + rc // 16)[None, :]
            s = tl.load(s_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
            w_lo = ((p & 0x0F).to(tl.float32) * s + z).to(x_lo.dtype)
            w_hi = ((p >> 4).to(tl.float32) * s + z).to(x_lo.dtype)
            acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
            acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok & (rn[None, :] < N))

    return triton, int8_kernel, int4_kernel


def quant_matmul(fmt: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16) @ dequant(W)^T + bias -> [M, N] in x's dtype; W in the row
    layout (int8 codes [N, K] or int4 bytes [N, K / 2], float16 scales and mins [N, K / 32])."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"quantized linear: activations must be float32, bfloat16 or float16, got {x.dtype}")
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    triton, int8_kernel, int4_kernel = _kernels()
    cfg = tile_config(n, k)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    common = dict(HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else None, **cfg)
    b = bias if bias is not None else out  # never read without HAS_BIAS
    if fmt == "int8":
        int8_kernel[grid](x, qweight, scales, b, out, m, n, k, **common)
    else:
        int4_kernel[grid](x, qweight, scales, mins, b, out, m, n, k, **common)
    return out


class TritonQuantizedLinear(nn.Module):
    """y = x @ dequant(W)^T + b with W in the int8 / int4 row layout (layers/linear.py), on the Triton kernels.
    Codes, scales, mins and bias are buffers, so `.to(device)` moves them."""

    def __init__(self, fmt: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
        self.fmt = fmt
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] * (2 if fmt == "int4" else 1)
        self.group_size = GROUP_SIZE
        if self.in_features % GROUP_SIZE or scales.shape != (self.out_features, self.in_features // GROUP_SIZE):
            raise ValueError(f"{fmt} row layout: codes {tuple(qweight.shape)} and scales {tuple(scales.shape)} "
                             f"do not describe groups of {GROUP_SIZE} input columns")
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(torch.float16).contiguous())
        self.register_buffer("mins", None if mins is None else mins.to(torch.float16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_float(cls, fmt: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "TritonQuantizedLinear":
        """weight [N, K] quantized by layers/linear.py's quantize_int8 / quantize_int4."""
        if fmt == "int8":
            return cls(fmt, *quantize_int8(weight), None, bias)
        if fmt == "int4":
            return cls(fmt, *quantize_int4(weight), bias)
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")

    @classmethod
    def from_q8_0(cls, qt, bias: torch.Tensor | None = None) -> "TritonQuantizedLinear":
        """A GGUF Q8_0 tensor as int8, its blocks copied (layers/linear.py q8_0_blocks): the file's values exactly."""
        return cls("int8", *q8_0_blocks(qt), None, bias)

    @classmethod
    def cat(cls, layers: list["TritonQuantizedLinear"]) -> "TritonQuantizedLinear":
        """One layer whose outputs are the given layers' side by side (same format and input width)."""
        bias = None
        if any(m.bias is not None for m in layers):
            bias = torch.cat([m.bias if m.bias is not None else m.scales.new_zeros(m.out_features, dtype=torch.float32)
                              for m in layers])
        mins = torch.cat([m.mins for m in layers]) if layers[0].fmt == "int4" else None
        return cls(layers[0].fmt, torch.cat([m.qweight for m in layers]), torch.cat([m.scales for m in layers]),
                   mins, bias)

    def row_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(qweight, scales, mins, group size), as layers/linear.py dequantize_torch takes them."""
        return self.qweight, self.scales, self.mins, self.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_matmul(self.fmt, x.reshape(-1, self.in_features), self.qweight, self.scales, self.mins, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}, group={self.group_size}"
