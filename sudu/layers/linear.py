"""Weight-only quantized linear layers (int8, int4) and `quantize_model`, which swaps a network's
nn.Linear modules for them in place.

Formats (accumulation in float32; see the dispatch below for the activations):
  int8: symmetric, one float16 scale per group of 32 input columns: w = s * q, q in [-127, 127].
        1.06 bytes per weight. Grouped rather than per-channel because it reproduces GGUF's Q8_0 blocks
        exactly (they are copied, not requantized) and keeps requantized Q5_0/Q6_K weights within a few
        percent of their own grid step.
  int4: asymmetric, float16 scale and min per group of 32: w = s * q + m, q in [0, 15]. 0.625 bytes
        per weight. Stored as the kernel reads it: rows in tiles of 16 (pack_int4), so that one vector
        operation covers one block of 16 rows.

Dispatch by the number of activation rows M (see benchmarks/linear_kernels.py for the figures):
  M <  PREFILL_MIN_ROWS  the native kernel (sudu/kernels/quant_linear.cpp): activations rounded to int8 in
                         blocks of 32 (llama.cpp's Q8 activations), integer dot products against the
                         quantized weights (AVX2, or AVX-512 VNNI where present), each weight row read from
                         memory once per call whatever M is. One row is bound by memory bandwidth; a batch
                         of 8 costs ~4x one row, not 8x. Every row takes the same float operations at every
                         M and on either instruction set, so results are bit for bit independent of the
                         batch: greedy speculative decoding stays identical to plain decoding.
  M >= PREFILL_MIN_ROWS  prefill chunks: dequantize slices of output channels (each temporary under
                         DEQUANT_SLICE_BYTES) and run GEMMs, in bfloat16 on CPUs with native bf16
                         dot products (avx512_bf16 / AMX: ~2x the kernel's rate from ~256 rows up), else in
                         float32 (the kernel stays faster up to its 512 rows, so the switch is at 513).
Without the extension (SUDU_NO_EXT=1, no AVX2, failed compile) every call takes the second path with
PyTorch ops: correct, but decode loses the quantization speed-up. (PyTorch's own packed kernels,
_weight_int8pack_mm / _weight_int4pack_mm_for_cpu, need bf16 activations, per-channel int8 or their own
int4 layout, and read the weights once per row on AVX2-only CPUs: see docs/cpu_speed.md.)
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sudu import kernels

log = logging.getLogger(__name__)

FORMATS = ("int8", "int4")
GROUP_SIZE = 32
DEQUANT_SLICE_BYTES = 64 << 20


def _cpu_has_native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & kernels.cpu_flags())


PREFILL_DTYPE = torch.bfloat16 if _cpu_has_native_bf16() else torch.float32
PREFILL_MIN_ROWS = 256 if PREFILL_DTYPE == torch.bfloat16 else 513


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


# int4 weights as the kernel reads them: rows in tiles of TILE_ROWS (the last zero-padded), per tile and
# 32-block 256 code bytes (4 chunks of 64: lane l, bytes 4l..4l+3, holds row l's columns 8c..8c+3 in its low
# nibbles and 8c+4..8c+7 in its high ones) then the 16 float16 scales and 16 float16 mins: 320 bytes. See
# kernels/quant_linear.cpp for why.
TILE_ROWS, TILE_BLOCK_BYTES = 16, 320


def pack_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """The row layout (quantize_int4: [N, K / 2], scales and mins [N, K / group_size]) -> the kernel's tiles
    uint8 [ceil(N / 16), K / 32, 320]."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    nb, tiles = k // 32, -(-n // TILE_ROWS)
    pad = tiles * TILE_ROWS - n
    halves = qweight.reshape(n, nb, 1, 16)
    codes = torch.cat([halves & 0x0F, halves >> 4], dim=2).reshape(n, nb, 32)  # column order within a block
    s = scales.repeat_interleave(group_size // 32, dim=1)
    m = mins.repeat_interleave(group_size // 32, dim=1)
    if pad:
        codes = F.pad(codes, (0, 0, 0, 0, 0, pad))
        s, m = F.pad(s, (0, 0, 0, pad)), F.pad(m, (0, 0, 0, pad))
    c = codes.reshape(tiles, TILE_ROWS, nb, 4, 2, 4)  # tile, lane, block, chunk, nibble, byte
    code_bytes = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, nb, 256)

    def per_tile(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(tiles, TILE_ROWS, nb).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([code_bytes, per_tile(s), per_tile(m)], dim=2).contiguous()


def unpack_int4(tiles: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_int4's inverse for its first n rows, with scales and mins per 32 columns: (qweight [n, K / 2],
    scales, mins [n, K / 32])."""
    t, nb = tiles.shape[0], tiles.shape[1]
    b = tiles[:, :, :256].reshape(t, nb, 4, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)  # tile, lane, block, chunk, byte
    codes = torch.stack([b & 0x0F, b >> 4], dim=4).reshape(t * TILE_ROWS, nb, 32)[:n]
    qweight = (codes[:, :, :16] | (codes[:, :, 16:] << 4)).reshape(n, nb * 16).contiguous()

    def per_row(v: torch.Tensor) -> torch.Tensor:
        return v.contiguous().view(torch.float16).transpose(1, 2).reshape(t * TILE_ROWS, nb)[:n].contiguous()

    return qweight, per_row(tiles[:, :, 256:288]), per_row(tiles[:, :, 288:])


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

    Built from the row layout (quantize_int8 / quantize_int4 output). int8 keeps it (`qweight` [N, K],
    `scales`); int4 stores only the kernel's tiles (pack_int4) in `qweight` [tiles, K / 32, 320], with
    `scales` and `mins` empty: `row_layout()` gives the rows back."""

    def __init__(self, fmt: str, qweight, scales, mins, bias, in_features: int, group_size: int = GROUP_SIZE,
                 out_features: int | None = None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
        self.fmt = fmt
        self.in_features = in_features
        self.group_size = group_size
        empty = torch.empty(0, dtype=torch.float16)
        if fmt == "int4" and qweight.dim() == 2:  # the row layout: pack it
            self.out_features = qweight.shape[0]
            qweight, scales, mins = pack_int4(qweight, scales, mins, group_size), empty, empty
        elif fmt == "int4":  # tiles already (fuse_linears)
            self.out_features, scales, mins = out_features, empty, empty
        else:
            self.out_features = qweight.shape[0]
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("mins", mins.contiguous() if mins is not None else empty)
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
        """(qweight, scales, mins, group size) in the row layout dequantize_torch takes (int4: per-32 groups)."""
        if self.fmt == "int8":
            return self.qweight, self.scales, None, self.group_size
        return (*unpack_int4(self.qweight, self.out_features), 32)

    def select_rows(self, rows: torch.Tensor) -> "QuantizedLinear":
        """A layer computing only the given output rows (a draft model's reduced head)."""
        q, s, m, g = self.row_layout()
        bias = self.bias[rows] if self.bias is not None else None
        return QuantizedLinear(self.fmt, q[rows], s[rows], m[rows] if m is not None else None, bias,
                               self.in_features, g)

    def fits_native_stack(self) -> bool:
        """Whether kernels/decoder.cpp can call this layer as it is: it passes group size 32 and uses the
        kernel's output as is (int4: 16 * tiles columns)."""
        return self.out_features % TILE_ROWS == 0 if self.fmt == "int4" else self.group_size == 32

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._slice_dequantized(0, self.out_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:  # the engine's case: no reshapes, no casts
            if self._ext is not None and x.shape[0] < PREFILL_MIN_ROWS:
                y = self._ext.qlinear(x, self.qweight, self.scales, self.mins, self.group_size, self.bias)
                # int4: [M, 16 * tiles], padding rows included
                return y if y.shape[1] == self.out_features else y[:, :self.out_features].contiguous()
            return self._dequantized_gemm(x)
        shape = x.shape
        y = self.forward(x.reshape(-1, self.in_features).float())
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _dequantized_gemm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = PREFILL_DTYPE if self._ext is not None else torch.float32
        xg = x.to(dtype)
        # slices of whole tiles (int4)
        rows_per_slice = max(TILE_ROWS, DEQUANT_SLICE_BYTES // (4 * self.in_features) // TILE_ROWS * TILE_ROWS)
        if rows_per_slice >= self.out_features:
            y = F.linear(xg, self.dequantized_weight(dtype))
            return y.float() + self.bias if self.bias is not None else y.float()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        for n0 in range(0, self.out_features, rows_per_slice):
            n1 = min(n0 + rows_per_slice, self.out_features)
            out[:, n0:n1] = F.linear(xg, self._slice_dequantized(n0, n1, dtype))
        return out + self.bias if self.bias is not None else out

    def _slice_dequantized(self, n0: int, n1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows n0..n1 (int4: n0 a multiple of 16) dequantized."""
        native = self._ext is not None and dtype in (torch.float32, torch.bfloat16)
        if self.fmt == "int8":
            q, s = self.qweight[n0:n1], self.scales[n0:n1]
            if native:
                return self._ext.dequantize(q, s, self.mins, self.group_size, dtype == torch.bfloat16)
            return dequantize_torch("int8", q, s, None, self.group_size).to(dtype)
        tiles = self.qweight[n0 // TILE_ROWS:-(-n1 // TILE_ROWS)]
        if native:
            w = self._ext.dequantize(tiles, self.scales, self.mins, 32, dtype == torch.bfloat16)
            return w[:n1 - n0] if w.shape[0] != n1 - n0 else w
        q, s, m = unpack_int4(tiles, n1 - n0)
        return dequantize_torch("int4", q, s, m, 32).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}, group={self.group_size}"


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing the given layers' outputs side by side (concatenated along the last dim), for
    layers that read the same input: q/k/v, gate/up. Fewer, larger calls: less per-call overhead, and the
    activations are read (and, quantized, rounded to int8) once. Each output column is computed exactly as
    before: the quantized kernel's rows do not interact, and float32 GEMM columns do not either. Returns
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
    if all(isinstance(m, QuantizedLinear) for m in layers):
        if len({(m.fmt, m.in_features, m.group_size) for m in layers}) != 1:
            return None
        bias = None
        if any(m.bias is not None for m in layers):
            bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in layers])
        n = sum(m.out_features for m in layers)
        if first.fmt == "int4" and all(m.out_features % TILE_ROWS == 0 for m in layers):  # whole tiles
            return QuantizedLinear("int4", torch.cat([m.qweight for m in layers]), None, None, bias,
                                   first.in_features, first.group_size, out_features=n)
        parts = [m.row_layout() for m in layers]
        mins = torch.cat([p[2] for p in parts]) if first.fmt == "int4" else None
        return QuantizedLinear(first.fmt, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                               mins, bias, first.in_features, parts[0][3])
    return None


# What `--quantization auto` (the default) picks for a checkpoint whose weights are already quantized
# (GGUF files such as the catalog's Q4_K_M): the fastest format that keeps greedy agreement with float32
# >= 95% and perplexity within +3% on the default model, where a check at first load finds it holds the
# checkpoint's accuracy (engine/auto_format.py; else int8). Float checkpoints stay float.
AUTO_FORMAT = "int4"
# ... except the output head, which `auto` keeps at 8 bits (as llama.cpp's Q4_K_M keeps it at 6-8): the most
# sensitive matrix (it alone decides the argmax), and in the catalog's files already Q8_0, copied exactly.
# Costs ~1 ms per decoded token on the 0.5B. Measured (tests/test_quantization_accuracy.py,
# docs/cpu_speed.md): int4 everywhere 96.1%, +3.30% (misses); auto 96.7%, +1.41%; int8 98.0%, +1.00%.
AUTO_HEAD_FORMAT = "int8"
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


def quantize_model(model: nn.Module, ckpt, fmt: str, group_size: int = GROUP_SIZE,
                   overrides: dict[str, str] | None = None) -> nn.Module:
    """Replace every nn.Linear whose input width is a multiple of the group size with a QuantizedLinear,
    in place, in format `fmt` or, for the modules named in `overrides`, the format given there. Q8_0
    tensors in a GGUF checkpoint become int8 by copying their blocks; everything else is quantized from
    the loaded float weights. Layers that do not fit the group size stay float."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization {fmt!r}; expected none, {', '.join(FORMATS)}")
    overrides = overrides or {}
    replaced, kept = 0, []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        fmt_here = overrides.get(name, fmt)
        if module.in_features % group_size != 0 or group_size % 32 != 0:
            kept.append(name)
            continue
        qt = ckpt.quantized(f"{name}.weight") if ckpt is not None else None
        with torch.no_grad():
            if fmt_here == "int8" and group_size == 32 and qt is not None and qt.ggml_type == "Q8_0":
                q, s = q8_0_blocks(qt)
                new = QuantizedLinear("int8", q, s, None, module.bias, module.in_features, group_size)
            else:
                new = QuantizedLinear.from_float(fmt_here, module.weight, module.bias, group_size)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced += 1
    if kept:
        log.warning("quantization %s: kept %d linear layers in float (input width not a multiple of %d): %s",
                    fmt, len(kept), group_size, ", ".join(kept[:3]))
    log.info("quantization %s: %d linear layers, native kernels %s", fmt, replaced,
             "on" if kernels.load() is not None else f"off ({kernels.disabled_reason() or 'compile failed'})")
    return model
