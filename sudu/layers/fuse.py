"""fuse_linears: layers that read the same input (q/k/v, gate/up) as one layer computing their outputs side by
side, whatever they run: float GEMMs, the native kernels' formats (int8, int4, a GGUF file's segmented blocks)
or the CUDA path's Triton layers."""
from __future__ import annotations

import torch
from torch import nn

from sudu.cuda.quant_linear import TritonQuantizedLinear
from sudu.layers import gguf_native
from sudu.layers.linear import TILE_ROWS, QuantizedLinear


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
        # built on the meta device and given the concatenated tensors: no random initialisation to overwrite
        fused = nn.Linear(first.in_features, sum(m.out_features for m in layers),
                          bias=any(m.bias is not None for m in layers), dtype=first.weight.dtype, device="meta")
        with torch.no_grad():
            fused.weight = nn.Parameter(torch.cat([m.weight for m in layers]), requires_grad=False)
            if fused.bias is not None:
                fused.bias = nn.Parameter(torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                                                     for m in layers]), requires_grad=False)
        return fused.eval()
    if all(isinstance(m, QuantizedLinear) for m in layers) and any(m.fmt == "native" for m in layers):
        # GGUF formats, possibly several: one segmented tensor (layers/gguf_native.py), whole tiles only
        if len({m.in_features for m in layers}) != 1 or any(m.out_features % TILE_ROWS for m in layers):
            return None
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
    if all(isinstance(m, TritonQuantizedLinear) for m in layers):
        if len({(m.fmt, m.in_features) for m in layers}) != 1:
            return None
        return TritonQuantizedLinear.cat(layers)
    return None
