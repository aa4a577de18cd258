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
AVX-512 VNNI where present), each weight row read from memory once per call whatever M is. One row is bound
by memory bandwidth; a batch of 8 costs far less than 8 rows one by one. Every row takes the same float
operations at every M and on either instruction set, so results are bit for bit independent of the batch,
of how a prompt is chunked and of what is cached (docs/exactness.md).
With --fast-math (fast_prefill below) prompt chunks of PREFILL_MIN_ROWS+ rows instead dequantize slices of
output channels (each temporary under DEQUANT_SLICE_BYTES) and run GEMMs, where that is faster on the CPU's
multiply units (prefill_path): with AMX tiles, bfloat16 GEMMs from 256 rows; AVX2 only, float32 GEMMs from
513; with AVX-512 VNNI and no AMX, never (its int8 dot products issue at twice bfloat16's rate there). A
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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sudu import kernels

log = logging.getLogger(__name__)

FORMATS = ("int8", "int4")
GROUP_SIZE = 32
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
    - AVX2 only: float32 GEMMs catch up with the kernel's `maddubs` at about 512 rows."""
    if _cpu_has_amx_bf16():
        return torch.bfloat16, 256
    if kernels.cpu_has_vnni():
        return torch.float32, NEVER
    return torch.float32, 513


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


def quantize_int8(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], scales float16 [N, K / group_size])."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    scales = (g.abs().amax(dim=-1) / 127.0).half()
    # Divide by the float16-rounded scale actually stored, so dequantization is consistent with it.
    s = scales.float().clamp_min(torch.finfo(torch.float16).tiny).unsqueeze(-1)
    q = torch.round(g / s).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), scales


def quantize_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (packed uint8 [N, K / 2], scales, mins float16 [N, K / group_size])."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15.0).half()
    mins = lo.half()
    s = scales.float().clamp_min(torch.finfo(torch.float16).tiny).unsqueeze(-1)
    q = torch.round((g - mins.float().unsqueeze(-1)) / s).clamp_(0, 15).to(torch.uint8)
    # Sub-blocks of 32: byte j holds element j (low nibble) and j + 16 (high nibble); see quant_linear.cpp.
    q = q.reshape(n, k // 32, 2, 16)
    packed = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, k // 2)
    return packed.contiguous(), scales, mins


def dequantize_torch(fmt: str, qweight, scales, mins, group_size: int) -> torch.Tensor:
    """Reference dequantization in PyTorch ops (the fallback path and the tests' ground truth), of the row
    layout (quantize_int8 / quantize_int4 output)."""
    n = qweight.shape[0]
    if fmt == "int8":
        q = qweight.float().reshape(n, -1, group_size)
        return (q * scales.float().unsqueeze(-1)).reshape(n, -1)
    packed = qweight.reshape(n, -1, 1, 16)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=2).float().reshape(n, -1, group_size)
    return (q * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)).reshape(n, -1)


# Weights as the kernel reads them (kernels/quant_linear.cpp explains the layouts): rows in tiles of
# TILE_ROWS, the last zero-padded.
#   int4, per tile and 32-block, 320 bytes: 256 code bytes (4 chunks of 64: lane l, bytes 4l..4l+3, holds
#         row l's columns 8c..8c+3 in its low nibbles and 8c+4..8c+7 in its high ones), then the 16
#         float16 scales and the 16 float16 mins.
#   int8, per tile and pair of blocks, 1088 bytes: each block's 512 code bytes (8 chunks of 64: lane l =
#         row l's columns 4c..4c+3, as q + 128), then the two blocks' 16 float16 scales; an odd last block
#         is paired with a zero one. Shape [tiles, ceil(blocks / 2), 1088].
TILE_ROWS, TILE_BLOCK_BYTES = 16, {"int4": 320, "int8": 1088}


def _tiled(v: torch.Tensor, tiles: int) -> torch.Tensor:
    """[tiles * 16, blocks, ...] -> [tiles, blocks, 16, ...]"""
    return v.reshape(tiles, TILE_ROWS, *v.shape[1:]).transpose(1, 2)


def _untiled(v: torch.Tensor) -> torch.Tensor:
    """_tiled's inverse."""
    return v.transpose(1, 2).reshape(v.shape[0] * TILE_ROWS, v.shape[1], *v.shape[3:])


def pack(fmt: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
         group_size: int) -> torch.Tensor:
    """The row layout (quantize_int8 / quantize_int4: codes, scales and mins [N, K / group_size]) -> the
    kernel's tiles uint8 [ceil(N / 16), K / 32, TILE_BLOCK_BYTES[fmt]]."""
    n = qweight.shape[0]
    if fmt == "int4":
        halves = qweight.reshape(n, -1, 1, 16)
        codes = torch.cat([halves & 0x0F, halves >> 4], dim=2).reshape(n, -1, 32)  # column order in a block
    else:
        codes = (qweight.view(torch.uint8) ^ 0x80).reshape(n, -1, 32)  # q + 128
    nb, tiles = codes.shape[1], -(-n // TILE_ROWS)
    pad = tiles * TILE_ROWS - n
    per_block = [v.repeat_interleave(group_size // 32, dim=1) for v in (scales, mins) if v is not None]
    codes = F.pad(codes, (0, 0, 0, 0, 0, pad), value=0 if fmt == "int4" else 0x80)  # padding rows: q = 0
    halves16 = [_tiled(F.pad(v, (0, 0, 0, pad)), tiles).contiguous().view(torch.uint8) for v in per_block]
    if fmt == "int4":
        c = _tiled(codes, tiles).reshape(tiles, nb, TILE_ROWS, 4, 2, 4)  # tile, block, lane, chunk, nibble, byte
        code_bytes = (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(2, 3).reshape(tiles, nb, 256)
        return torch.cat([code_bytes, *halves16], dim=2).contiguous()
    c = _tiled(codes, tiles).reshape(tiles, nb, TILE_ROWS, 8, 4).transpose(2, 3).reshape(tiles, nb, 512)
    scale_bytes = halves16[0]
    if nb % 2:  # a zero block (q = 0, scale 0) to pair with the last
        c, scale_bytes = F.pad(c, (0, 0, 0, 1), value=0x80), F.pad(scale_bytes, (0, 0, 0, 1))
    pairs = (nb + 1) // 2
    return torch.cat([c.reshape(tiles, pairs, 1024), scale_bytes.reshape(tiles, pairs, 64)], dim=2).contiguous()


def unpack(fmt: str, tiles: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """pack's inverse for the first n rows of k columns, with scales (and mins) per 32 columns: (qweight,
    scales, mins)."""
    t, nb = tiles.shape[0], k // 32

    def halves(v: torch.Tensor) -> torch.Tensor:  # [t, nb, 32] bytes -> [n, nb] float16
        return _untiled(v.contiguous().view(torch.float16))[:n].contiguous()

    if fmt == "int4":
        b = tiles[:, :, :256].reshape(t, nb, 4, TILE_ROWS, 4).transpose(2, 3)  # tile, block, lane, chunk, byte
        codes = _untiled(torch.stack([b & 0x0F, b >> 4], dim=4).reshape(t, nb, TILE_ROWS, 32))[:n]
        qweight = (codes[:, :, :16] | (codes[:, :, 16:] << 4)).reshape(n, nb * 16).contiguous()
        return qweight, halves(tiles[:, :, 256:288]), halves(tiles[:, :, 288:])
    pairs = tiles.shape[1]
    c = tiles[:, :, :1024].reshape(t, 2 * pairs, 8, TILE_ROWS, 4)[:, :nb].transpose(2, 3).reshape(t, nb, TILE_ROWS, 32)
    qweight = (_untiled(c)[:n] ^ 0x80).reshape(n, nb * 32).contiguous().view(torch.int8)
    return qweight, halves(tiles[:, :, 1024:].reshape(t, 2 * pairs, 32)[:, :nb]), None


def q8_0_blocks(qt) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 blocks (per 32 weights: float16 scale, 32 int8) -> the int8 format, bit for bit."""
    rows = np.ascontiguousarray(qt.blocks).reshape(qt.shape[0], -1, 34)
    scales = torch.from_numpy(np.ascontiguousarray(rows[:, :, :2]).view(np.float16).reshape(qt.shape[0], -1))
    q = torch.from_numpy(np.ascontiguousarray(rows[:, :, 2:]).view(np.int8).reshape(qt.shape[0], -1))
    if qt.row_permutation is not None:
        perm = torch.from_numpy(np.asarray(qt.row_permutation, dtype=np.int64))
        q, scales = q[perm], scales[perm]
    return q.contiguous(), scales.contiguous()


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


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing the given layers' outputs side by side (concatenated along the last dim), for
    layers that read the same input: q/k/v, gate/up. Fewer, larger calls: less per-call overhead, and the
    activations are read (and, quantized, rounded to int8) once. Each output column is computed exactly as
    before: the quantized kernel's rows do not interact, and float32 GEMM columns do not either (nor do the
    CUDA path's Triton layers', sudu/cuda/quant_linear.py: their K loop depends on K only). Returns
    None when the layers cannot be fused (mixed kinds or formats)."""
    first = layers[0]
    if all(type(m) is nn.Linear for m in layers):
        if len({(m.in_features, m.weight.dtype) for m in layers}) != 1:
            return None
        fused = nn.Linear(first.in_features, sum(m.out_features for m in layers),
                          bias=any(m.bias is not None for m in layers), dtype=first.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([m.weight for m in layers]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                                            for m in layers]))
        return fused.eval().requires_grad_(False)
    if all(isinstance(m, QuantizedLinear) for m in layers) and any(m.fmt == "native" for m in layers):
        # GGUF formats, possibly several: one segmented tensor (layers/gguf_native.py), whole tiles only
        if len({m.in_features for m in layers}) != 1 or any(m.out_features % TILE_ROWS for m in layers):
            return None
        from sudu.layers import gguf_native

        parts = [p for m in layers for p in gguf_native.layer_segments(m)]
        if len({f for f, _ in parts}) > gguf_native.MAX_SEGMENTS:
            return None
        bias = None
        if any(m.bias is not None for m in layers):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in layers])
        return QuantizedLinear("native", gguf_native.segmented(first.in_features, parts), None, None, bias,
                               first.in_features, out_features=sum(m.out_features for m in layers))
    if all(isinstance(m, QuantizedLinear) for m in layers):
        if len({(m.fmt, m.in_features, m.group_size) for m in layers}) != 1:
            return None
        bias = None
        if any(m.bias is not None for m in layers):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in layers])
        n = sum(m.out_features for m in layers)
        if all(m.out_features % TILE_ROWS == 0 for m in layers):  # whole tiles
            return QuantizedLinear(first.fmt, torch.cat([m.qweight for m in layers]), None, None, bias,
                                   first.in_features, first.group_size, out_features=n)
        parts = [m.row_layout() for m in layers]
        mins = torch.cat([p[2] for p in parts]) if first.fmt == "int4" else None
        return QuantizedLinear(first.fmt, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                               mins, bias, first.in_features, parts[0][3])
    from sudu.cuda.quant_linear import TritonQuantizedLinear  # the CUDA path's layers (triton only when they run)

    if all(isinstance(m, TritonQuantizedLinear) for m in layers):
        if len({(m.fmt, m.in_features) for m in layers}) != 1:
            return None
        return TritonQuantizedLinear.cat(layers)
    return None


# What `--quantization auto` (the default) picks for a checkpoint whose weights are already quantized (GGUF
# files such as the catalog's Q4_K_M): the file's own blocks (layers/gguf_native.py), the file's exact
# values. int8 and int4 re-quantize them and stay as explicit choices (docs/cpu_speed.md compares the three).
# Float checkpoints stay float.
AUTO_FORMAT = "native"
FLOAT_GGML_TYPES = {"F32", "F16", "BF16"}


def resolve_format(requested: str, ckpt) -> str:
    """The weight format an engine runs: `requested`, or for "auto" AUTO_FORMAT when the checkpoint's
    linear weights come quantized and "none" when they come as floats."""
    if requested != "auto":
        return requested
    if ckpt is None or getattr(ckpt, "format", None) != "gguf":
        return "none"
    for name in ckpt.tensor_names():
        qt = ckpt.quantized(name)
        if name.endswith("proj.weight") and qt is not None and qt.ggml_type not in FLOAT_GGML_TYPES:
            return AUTO_FORMAT
    return "none"


def replace_linears(model: nn.Module, ckpt, fmt: str, group_size: int, build) -> int:
    """Every nn.Linear whose input width is a multiple of group_size (itself a multiple of 32) replaced in place
    by build(module, its GGUF tensor or None); the others stay float (a warning names them). Returns how many
    were replaced."""
    replaced, kept = 0, []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        if module.in_features % group_size != 0 or group_size % 32 != 0:
            kept.append(name)
            continue
        qt = ckpt.quantized(f"{name}.weight") if ckpt is not None else None
        with torch.no_grad():
            new = build(module, qt)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced += 1
    if kept:
        log.warning("quantization %s: kept %d linear layers in float (input width not a multiple of %d): %s",
                    fmt, len(kept), group_size, ", ".join(kept[:3]))
    return replaced


def quantize_model(model: nn.Module, ckpt, fmt: str, group_size: int = GROUP_SIZE) -> nn.Module:
    """Replace every nn.Linear whose input width is a multiple of the group size with a QuantizedLinear,
    in place, in format `fmt` (native: layers/gguf_native.py quantize_native). Q8_0
    tensors in a GGUF checkpoint become int8 by copying their blocks; everything else is quantized from
    the loaded float weights. Layers that do not fit the group size stay float."""
    if fmt == "native":
        from sudu.layers.gguf_native import quantize_native

        return quantize_native(model, ckpt)
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization {fmt!r}; expected none, native, {', '.join(FORMATS)}")

    def build(module: nn.Linear, qt) -> nn.Module:
        if fmt == "int8" and group_size == 32 and qt is not None and qt.ggml_type == "Q8_0":
            q, s = q8_0_blocks(qt)
            return QuantizedLinear("int8", q, s, None, module.bias, module.in_features, group_size)
        return QuantizedLinear.from_float(fmt, module.weight, module.bias, group_size)

    replaced = replace_linears(model, ckpt, fmt, group_size, build)
    log.info("quantization %s: %d linear layers, native kernels %s", fmt, replaced,
             "on" if kernels.load() is not None else f"off ({kernels.disabled_reason() or 'compile failed'})")
    return model
