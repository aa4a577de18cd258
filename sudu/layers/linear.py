"""Weight-only quantized linear layers (int8, int4) and `quantize_model`, which swaps a network's
nn.Linear modules for them in place.

Formats (accumulation in float32; see the dispatch below for the activations):
  int8: symmetric, one float16 scale per group of 32 input columns: w = s * q, q in [-127, 127].
        1.06 bytes per weight. Grouped rather than per-channel because it reproduces GGUF's Q8_0 blocks
        exactly (they are copied, not requantized) and keeps requantized Q5_0/Q6_K weights within a few
        percent of their own grid step.
  int4: asymmetric, float16 scale and min per group of 32: w = s * q + m, q in [0, 15]. 0.625 bytes
        per weight.
Both are stored as the kernel reads them: rows in tiles of 16 (pack), so that one vector operation
covers one block of 16 rows.

Dispatch (see benchmarks/linear_kernels.py for the figures): by default every call, whatever its number of
activation rows M, takes the native kernel (sudu/kernels/quant_linear.cpp): activations rounded to int8 in
blocks of 32 (llama.cpp's Q8 activations), integer dot products against the quantized weights (AVX2, or
AVX-512 VNNI where present; from 32 rows, AMX's int8 tiles where the OS grants them: kernels/amx_tiles.cpp,
the same integer sums and float steps), each weight row read from memory once per call whatever M is. One row
is bound by memory bandwidth; a batch of 8 costs far less than 8 rows one by one. Every row takes the same float
operations at every M and on either instruction set, so results are bit for bit independent of the batch,
of how a prompt is chunked and of what is cached (docs/exactness.md).
With --fast-math (fast_prefill below) prompt chunks of PREFILL_MIN_ROWS+ rows instead dequantize slices of
output channels (each temporary under DEQUANT_SLICE_BYTES) and run GEMMs, where that is faster on the CPU's
multiply units (prefill_path): with AMX tiles, bfloat16 GEMMs from 256 rows; elsewhere never (AVX-512 VNNI's
int8 dot products issue at twice bfloat16's rate; on AVX2 the integer kernel with int16 sums and q8_K
activations outruns float32 GEMMs at 2,048-row chunks: docs/exactness.md). A
row's numbers then depend on how many rows share its step: opt-in, with its price in docs/exactness.md.
Without the extension (SUDU_NO_EXT=1, no AVX2, failed compile) every call takes the second path with
PyTorch ops: correct, but decode loses the quantization speed-up. (PyTorch's own packed kernels,
_weight_int8pack_mm / _weight_int4pack_mm_for_cpu, need bf16 activations, per-channel int8 or their own
int4 layout, and read the weights once per row on AVX2-only CPUs: see docs/cpu_speed.md.)
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from sudu import kernels
from sudu.quant.formats import FORMATS, GROUP_SIZE, TILE_ROWS, dequantize_torch, pack, quantize_int4, quantize_int8, unpack

log = logging.getLogger(__name__)

DEQUANT_SLICE_BYTES = 64 << 20


def _cpu_has_amx_bf16() -> bool:
    """AMX's bfloat16 tiles listed by the CPU and granted by the OS (torch asks the kernel for them)."""
    return "amx_bf16" in kernels.cpu_flags() and torch.cpu._is_amx_tile_supported()


NEVER = 1 << 62  # PREFILL_MIN_ROWS where no row count takes the GEMM


def prefill_path() -> tuple[torch.dtype, int]:
    """--fast-math's (PREFILL_DTYPE, PREFILL_MIN_ROWS): the GEMM's element type for prompt chunks and the fewest
    rows that take it instead of the integer kernel, chosen by which is faster on this CPU's multiply units
    (`python -m benchmarks.native_kernels --rows 64,256,512,2048 --gemm`; figures in docs/cpu_speed.md):
    - AMX: oneDNN's bfloat16 tile GEMMs run at several times the kernel's rate from a few hundred rows;
    - AVX-512 VNNI without AMX (Zen 4, AVX-512 Xeons whose AMX is not granted): `vpdpbusd` does twice the
      multiply-adds per instruction of `vdpbf16ps`, so the kernel stays ahead at every row count;
    - AVX2 only: the kernel (int16 sums, q8_K activations) is ahead of float32 GEMMs too: a cold 2,048-token
      prompt ran at 0.63x the exact default's speed with them (docs/exactness.md), so it keeps every row
      count. --fast-math then changes nothing on these CPUs."""
    if _cpu_has_amx_bf16():
        return torch.bfloat16, 256
    return torch.float32, NEVER


# The invariant default: the integer kernel at every row count (fast_prefill switches it per engine step).
PREFILL_DTYPE, PREFILL_MIN_ROWS = torch.float32, NEVER


def fast_prefill(fast_math: bool) -> tuple[torch.dtype, int]:
    """(PREFILL_DTYPE, PREFILL_MIN_ROWS) an engine runs its steps with: the invariant default, or with
    fast_math prefill_path's GEMMs for long prompt chunks."""
    return prefill_path() if fast_math else (torch.float32, NEVER)


@contextlib.contextmanager
def prefill_path_as(min_rows: int, dtype: torch.dtype | None = None) -> Iterator[None]:
    """PREFILL_MIN_ROWS (and PREFILL_DTYPE, where given) set for the block's calls, restored after it:
    measurements that take a chosen path through the layers (engine/text_eval.py, benchmarks/native_kernels.py)."""
    global PREFILL_MIN_ROWS, PREFILL_DTYPE
    saved = PREFILL_MIN_ROWS, PREFILL_DTYPE
    PREFILL_MIN_ROWS, PREFILL_DTYPE = min_rows, dtype or PREFILL_DTYPE
    try:
        yield
    finally:
        PREFILL_MIN_ROWS, PREFILL_DTYPE = saved


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W)^T + b with W stored as int8 or int4 (module docstring); x of any float dtype.

    Built from the row layout (quantize_int8 / quantize_int4 output: codes, scales, mins) or, from
    fuse_linears, from tiles. Stores only the kernel's tiles (pack) in `qweight`; `row_layout()` gives the
    rows back."""

    def __init__(self, fmt: str, qweight, scales, mins, bias, in_features: int, group_size: int = GROUP_SIZE,
                 out_features: int | None = None):
        super().__init__()
        if fmt not in FORMATS and fmt != "native":
            raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS} or native")
        self.fmt = fmt
        self.in_features = in_features
        self.group_size = group_size
        if qweight.dim() == 2:  # the row layout
            self.out_features = qweight.shape[0]
            qweight = pack(fmt, qweight, scales, mins, group_size)
        else:
            self.out_features = out_features
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._ext = kernels.load()

    @classmethod
    def from_float(cls, fmt: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   group_size: int = GROUP_SIZE) -> "QuantizedLinear":
        if fmt == "int8":
            q, s = quantize_int8(weight, group_size)
            mins = None
        else:
            q, s, mins = quantize_int4(weight, group_size)
        return cls(fmt, q, s, mins, bias, weight.shape[1], group_size)

    def row_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(qweight, scales, mins, group size) in the row layout dequantize_torch takes (groups of 32); int8 and
        int4 only."""
        return (*unpack(self.fmt, self.qweight, self.out_features, self.in_features), 32)

    def select_rows(self, rows: torch.Tensor) -> "QuantizedLinear":
        """A layer computing only the given output rows (a draft model's reduced head; a native layer's rows
        in int8, close to the file's values: a draft only proposes tokens)."""
        if self.fmt == "native":
            bias = self.bias[rows] if self.bias is not None else None
            return QuantizedLinear.from_float("int8", self.dequantized_weight()[rows], bias)
        q, s, m, g = self.row_layout()
        bias = self.bias[rows] if self.bias is not None else None
        return QuantizedLinear(self.fmt, q[rows], s[rows], m[rows] if m is not None else None, bias,
                               self.in_features, g)

    def fits_native_stack(self) -> bool:
        """Whether kernels/decoder.cpp can call this layer as it is: it uses the kernel's output (16 * tiles
        columns) as is."""
        return self.out_features % TILE_ROWS == 0

    def weight_bytes(self) -> int:
        return self.qweight.numel()

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._slice_dequantized(0, self.out_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:  # the engine's case: no reshapes, no casts
            if self._ext is not None and x.shape[0] < PREFILL_MIN_ROWS:
                y = self._ext.qlinear(x, self.qweight, self.bias)  # [M, 16 * tiles], padding rows included
                return y if y.shape[1] == self.out_features else y[:, :self.out_features].contiguous()
            return self._dequantized_gemm(x)
        shape = x.shape
        y = self.forward(x.reshape(-1, self.in_features).float())
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def chunk_gemm(self, x: torch.Tensor, keep_gemm_dtype: bool = False) -> torch.Tensor:
        """What forward computes for a prompt chunk (x 2-D, PREFILL_MIN_ROWS+ rows, float32 or PREFILL_DTYPE):
        float32 out, or with keep_gemm_dtype (and no bias) the GEMM's own PREFILL_DTYPE output: the same
        values before their float32 copy (layers/mlp.py passes gate_up to the down projection this way)."""
        return self._dequantized_gemm(x, keep_gemm_dtype and self.bias is None)

    def _dequantized_gemm(self, x: torch.Tensor, keep_gemm_dtype: bool = False) -> torch.Tensor:
        dtype = PREFILL_DTYPE if self._ext is not None else torch.float32
        out_dtype = dtype if keep_gemm_dtype else torch.float32
        xg = x.to(dtype)
        # slices of whole tiles
        row_bytes = dtype.itemsize * self.in_features
        rows_per_slice = max(TILE_ROWS, DEQUANT_SLICE_BYTES // row_bytes // TILE_ROWS * TILE_ROWS)
        if rows_per_slice >= self.out_features:
            y = F.linear(xg, self.dequantized_weight(dtype)).to(out_dtype)
            return y.add_(self.bias) if self.bias is not None else y
        out = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        for n0 in range(0, self.out_features, rows_per_slice):
            n1 = min(n0 + rows_per_slice, self.out_features)
            out[:, n0:n1] = F.linear(xg, self._slice_dequantized(n0, n1, dtype))
        return out.add_(self.bias) if self.bias is not None else out

    def _slice_dequantized(self, n0: int, n1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows n0..n1 (n0 a multiple of 16) dequantized."""
        if self.fmt == "native":  # a segmented tensor: the kernels' dequantization (native layers need them)
            w = self._ext.dequantize(self.qweight, dtype == torch.bfloat16, n0 // TILE_ROWS, -(-n1 // TILE_ROWS))
            return w[:n1 - n0].to(dtype)
        tiles = self.qweight[n0 // TILE_ROWS:-(-n1 // TILE_ROWS)]
        if self._ext is not None and dtype in (torch.float32, torch.bfloat16):
            w = self._ext.dequantize(tiles, dtype == torch.bfloat16)  # whole tiles (int8: whole block pairs)
            return w[:n1 - n0, :self.in_features] if w.shape != (n1 - n0, self.in_features) else w
        q, s, m = unpack(self.fmt, tiles, n1 - n0, self.in_features)
        return dequantize_torch(self.fmt, q, s, m, 32).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}, group={self.group_size}"


def prefill_attention_dtype(model: nn.Module) -> torch.dtype | None:
    """The element type for the attention of steps whose linears take the dequantize + GEMM path
    (PREFILL_MIN_ROWS+ rows) when that path runs in bfloat16 (prefill_path: AMX, and the kernels
    extension, so quantized linears: QuantizedLinear._dequantized_gemm), else None (attention in the
    queries' dtype, as for float weights, whose users chose float32 numerics)."""
    if PREFILL_DTYPE != torch.bfloat16:
        return None
    quantized = any(isinstance(m, QuantizedLinear) and m._ext is not None for m in model.modules())
    return PREFILL_DTYPE if quantized else None


class FloatWeight(nn.Module):
    """A weight matrix that quantize_model leaves alone (it swaps nn.Linear only): MoE routers, whose
    small errors change which experts run, and MLA's kv_b_proj, which latent attention splits per head."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
