"""GGUF's own quantized blocks as the native kernels read them (`--quantization native`).

A GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K and Q6_K tensors are run with the file's codes and scales,
bit for bit; only their order changes, into tiles of 16 rows (kernels/gguf_tiles.cpp has the layouts):
  Q8_0        -> sudu's int8 tile (w = d * q: the same codes and float16 scales)
  Q4_0, Q4_1  -> sudu's int4 tile (w = s * q + m with s = d and m = -8 d (exact in float16), or Q4_1's m)
  Q5_0, Q4_K, Q5_K, Q6_K -> their own tiles, the same bits per weight (Q4_K/Q5_K: 4 bytes more per row
                 and 256 weights, their 6-bit scales unpacked to bytes).
No weight is re-quantized and no float copy is kept. Types without a kernel (Q2_K, Q3_K, Q5_1, Q8_K) are
re-quantized to int8 by quantize_native, which says so.

Several such tensors can share one weight tensor, a *segmented* one (kernels/quant_linear.cpp weights_of):
a header of 16 int64 (magic, K, number of segments, then per segment its format, tiles and byte offset)
followed by each segment's tiles. That is how a fused q/k/v whose parts the file stores in different formats
(the 0.5B's Q5_0 q/k and Q8_0 v) stays one call.
"""
from __future__ import annotations

import numpy as np
import torch

from sudu.layers import linear
from sudu.quant.formats import TILE_ROWS, pack, q8_0_blocks

# kernels/quant_tiles.h Format
INT8, INT4, Q5_0, Q4_K, Q5_K, Q6_K = range(6)
NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
SEGMENTED_MAGIC = 0x3130515544555353
HEADER_INT64, MAX_SEGMENTS, ALIGN = 16, 4, 64
TILE = TILE_ROWS


def tiles(qt) -> tuple[int, torch.Tensor]:
    """A GGUF tensor of NATIVE_TYPES -> (format, its tiles uint8 [tiles, bytes per tile]). Needs the native
    kernels (they repack the K-quants and Q5_0)."""
    from sudu import kernels

    n, k = qt.shape
    ntiles = -(-n // TILE)
    if qt.ggml_type == "Q8_0":  # q8_0_blocks permutes the rows itself
        q, s = q8_0_blocks(qt)
        return INT8, pack("int8", q, s, None, 32).reshape(ntiles, -1)
    blocks = qt.blocks if qt.row_permutation is None else qt.blocks[np.asarray(qt.row_permutation)]
    if qt.ggml_type in ("Q4_0", "Q4_1"):  # w = d q + m: sudu's int4 tile, m = -8 d for Q4_0 (exact in float16)
        b = np.ascontiguousarray(blocks).reshape(n, k // 32, -1)
        d = torch.from_numpy(np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0])
        m = torch.from_numpy(np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0]) if qt.ggml_type == "Q4_1" else -8 * d
        if not torch.isfinite(m).all():  # -8 d past float16's range: no exact int4 tile
            raise ValueError("Q4_0 scale too large for the int4 tile")
        packed = torch.from_numpy(np.ascontiguousarray(b[..., -16:])).reshape(n, k // 2)  # the int4 row layout
        return INT4, pack("int4", packed, d, m, 32).reshape(ntiles, -1)
    fmt = {"Q5_0": Q5_0, "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}[qt.ggml_type]
    return fmt, kernels.load().repack_gguf(torch.from_numpy(np.ascontiguousarray(blocks)), fmt, k)


def segmented(k: int, parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Segments (format, tiles [n, bytes per tile]) -> one segmented weight tensor, uint8 [bytes]. Adjacent
    segments of one format are merged (their tiles concatenated)."""
    merged: list[tuple[int, torch.Tensor]] = []
    for fmt, t in parts:
        t = t.reshape(t.shape[0], -1)
        if merged and merged[-1][0] == fmt:
            merged[-1] = (fmt, torch.cat([merged[-1][1], t]))
        else:
            merged.append((fmt, t))
    if len(merged) > MAX_SEGMENTS:
        raise ValueError(f"more than {MAX_SEGMENTS} weight formats in one layer")
    header = np.zeros(HEADER_INT64, dtype=np.int64)
    header[:3] = (SEGMENTED_MAGIC, k, len(merged))
    offset, chunks = 8 * HEADER_INT64, []
    for i, (fmt, t) in enumerate(merged):
        offset = -(-offset // ALIGN) * ALIGN
        header[3 + 3 * i:6 + 3 * i] = (fmt, t.shape[0], offset)
        chunks.append((offset, t.reshape(-1)))
        offset += t.numel()
    out = torch.zeros(offset, dtype=torch.uint8)
    out[:8 * HEADER_INT64] = torch.from_numpy(header.view(np.uint8))
    for at, flat in chunks:
        out[at:at + flat.numel()] = flat
    return out


def segments(q: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """segmented's inverse: [(format, tiles [n, bytes per tile])] (views into q)."""
    header = q[:8 * HEADER_INT64].numpy().view(np.int64)
    from sudu import kernels

    out = []
    for i in range(int(header[2])):
        fmt, n, at = (int(v) for v in header[3 + 3 * i:6 + 3 * i])
        size = n * kernels.load().tile_bytes(fmt, int(header[1]))
        out.append((fmt, q[at:at + size].view(n, -1)))
    return out


def layer_segments(layer) -> list[tuple[int, torch.Tensor]]:
    """A QuantizedLinear's weights as segments (format, tiles): its own (native) or its one int8/int4 range."""
    if layer.fmt == "native":
        return segments(layer.qweight)
    return [(INT8 if layer.fmt == "int8" else INT4, layer.qweight.reshape(layer.qweight.shape[0], -1))]


def native_layer(qt, bias: torch.Tensor | None) -> "linear.QuantizedLinear":
    """The QuantizedLinear running GGUF tensor qt (a NATIVE_TYPES type) with the file's own blocks."""
    n, k = qt.shape
    fmt, t = tiles(qt)
    if fmt in (INT8, INT4):  # sudu's own tiles, as quantize_model builds them
        name = "int8" if fmt == INT8 else "int4"
        per_tile = (-(-(k // 32) // 2), 1088) if fmt == INT8 else (k // 32, 320)
        return linear.QuantizedLinear(name, t.reshape(t.shape[0], *per_tile), None, None, bias, k, out_features=n)
    return linear.QuantizedLinear("native", segmented(k, [(fmt, t)]), None, None, bias, k, out_features=n)


class QuantizedEmbedding(torch.nn.Module):
    """An embedding table kept as a GGUF file's blocks in tiles: a lookup dequantizes the rows it needs
    (kernels embedding_rows), the file's values exactly, and no float copy of the table exists. With tied
    embeddings it shares the output head's tiles."""

    def __init__(self, qweight: torch.Tensor, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        from sudu import kernels

        self.register_buffer("qweight", qweight)
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self._ext = kernels.load()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self._ext.embedding_rows(self.qweight, input_ids.reshape(-1), self.embedding_dim)
        return rows.reshape(*input_ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, quantized tiles"


def native_blocks(ckpt, name: str, module: torch.nn.Module):
    """The GGUF tensor `name`.weight whose blocks a native layer runs in place of module (an nn.Linear or
    nn.Embedding of that weight's shape), or None where it has none: not in the file as a NATIVE_TYPES
    tensor, another shape (a file's merged tensors), or rows not a whole number of 32-blocks."""
    qt = ckpt.quantized(f"{name}.weight") if ckpt is not None else None
    width = module.in_features if isinstance(module, torch.nn.Linear) else module.embedding_dim
    if qt is None or qt.ggml_type not in NATIVE_TYPES or tuple(qt.shape) != tuple(module.weight.shape) or width % 32:
        return None
    return qt


def _native_embedding(model: torch.nn.Module, ckpt, tied_head) -> bool:
    """model.model.embed_tokens as a QuantizedEmbedding over the file's blocks (tied_head: the output head
    layer built from the same tensor, whose tiles it then shares). False where the file's table has no
    native format (it stays float)."""
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not isinstance(emb, torch.nn.Embedding) or native_blocks(ckpt, "model.embed_tokens", emb) is None:
        return False
    qt = ckpt.quantized("model.embed_tokens.weight")
    qweight = tied_head.qweight if tied_head is not None else native_layer(qt, None).qweight
    model.model.embed_tokens = QuantizedEmbedding(qweight, emb.num_embeddings, emb.embedding_dim, emb.weight.dtype)
    return True


def native_tensor_names(ckpt, meta_model: torch.nn.Module) -> frozenset[str]:
    """The checkpoint tensors quantize_native will run from their blocks (every nn.Linear weight and the token
    embedding whose file type has a kernel), found on a meta-device build of the network (the caller builds
    it: layers never build a model): the loader need not dequantize them (Checkpoint.tensors placeholders).
    Empty without the native kernels (quantize_native then keeps float weights)."""
    from torch import nn

    from sudu import kernels

    if getattr(ckpt, "format", None) != "gguf" or kernels.load() is None:
        return frozenset()
    return frozenset(f"{name}.weight" for name, m in meta_model.named_modules()
                     if isinstance(m, (nn.Linear, nn.Embedding)) and native_blocks(ckpt, name, m) is not None)


def quantize_native(model: torch.nn.Module, ckpt) -> torch.nn.Module:
    """Replace every nn.Linear whose weight the checkpoint stores in a NATIVE_TYPES block format with a layer
    running those blocks, in place, and the token embedding with a lookup from its blocks. Other quantized
    types (and float weights of a quantized file, and layers built from a file's merged tensors, such as
    GGUF's stacked experts) become int8, and the log says which; without the native kernels every layer
    keeps its float weights, the file's exact dequantized values."""
    from torch import nn

    from sudu import kernels

    if kernels.load() is None:
        linear.log.warning("quantization native: the native kernels are unavailable (%s); running float weights",
                           kernels.disabled_reason() or "compile failed")
        return model
    counts: dict[str, int] = {}
    requantized: list[str] = []
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    emb_weight = emb.weight if isinstance(emb, nn.Embedding) else None
    tied_head = None
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module.in_features % 32:
            continue
        qt = ckpt.quantized(f"{name}.weight") if ckpt is not None else None
        tied = emb_weight is not None and module.weight is emb_weight
        # a head tied to the embedding runs the table's blocks: the file stores the table once
        native = native_blocks(ckpt, "model.embed_tokens" if qt is None and tied else name, module)
        with torch.no_grad():
            if native is not None:
                new = native_layer(native, module.bias)
                counts[native.ggml_type] = counts.get(native.ggml_type, 0) + 1
                if tied:
                    tied_head = new
            else:
                new = linear.QuantizedLinear.from_float("int8", module.weight, module.bias)
                requantized.append(f"{name} ({qt.ggml_type if qt is not None else 'float'})")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if _native_embedding(model, ckpt, tied_head):
        counts["embedding"] = 1
    if requantized:
        linear.log.warning("quantization native: %d layers have no native block format and run as int8: %s",
                           len(requantized), ", ".join(requantized[:3]) + (" ..." if len(requantized) > 3 else ""))
    linear.log.info("quantization native: %s", ", ".join(f"{n} {t}" for t, n in sorted(counts.items())))
    return model
