"""GGUF's own quantized blocks as the native kernels read them (`--quantization native`).

A GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K and Q6_K tensors are run with the file's codes and scales,
bit for bit; only their order changes, into tiles of 16 rows (kernels/gguf_tiles.cpp has the layouts):
  Q8_0        -> sudu's int8 tile (w = d * q: the same codes and float16 scales)
  Q4_0, Q4_1  -> sudu's int4 tile (w = s * q + m with s = d and m = -8 d (exact in float16), or Q4_1's m)
  Q5_0, Q4_K, Q5_K, Q6_K -> their own tiles, the same bits per weight (Q4_K/Q5_K: 4 bytes more per row
                 and 256 weights, their 6-bit scales unpacked to bytes).
No weight is re-quantized and no float copy is kept. Types without a kernel (Q2_K, Q3_K, Q5_1, Q8_K) are
re-quantized to int8 by the caller (quantize_model), which says so.

Several such tensors can share one weight tensor, a *segmented* one (kernels/quant_linear.cpp weights_of):
a header of 16 int64 (magic, K, number of segments, then per segment its format, tiles and byte offset)
followed by each segment's tiles. That is how a fused q/k/v whose parts the file stores in different formats
(the 0.5B's Q5_0 q/k and Q8_0 v) stays one call.
"""
from __future__ import annotations

import numpy as np
import torch

from sudu.layers import linear

# kernels/quant_tiles.h Format
INT8, INT4, Q5_0, Q4_K, Q5_K, Q6_K = range(6)
FORMAT_NAMES = {INT8: "Q8_0", INT4: "Q4_0", Q5_0: "Q5_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
SEGMENTED_MAGIC = 0x3130515544555353
HEADER_INT64, MAX_SEGMENTS, ALIGN = 16, 4, 64
TILE = linear.TILE_ROWS


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> float16 [...]"""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-block -> its 32 low-4-bit codes (elements 0..15 low nibbles, 16..31 high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes [..., 12] -> (6-bit scales, 6-bit mins) [..., 8] (llama.cpp get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], axis=-1), np.concatenate([lo_m, hi_m], axis=-1)


def decode(blocks: np.ndarray, ggml_type: str, k: int) -> dict:
    """One tensor's blocks [rows, bytes per row] -> its unsigned codes uint8 [rows, k] and its scale fields
    (the file's values, unchanged)."""
    n = blocks.shape[0]
    if ggml_type in ("Q4_0", "Q4_1", "Q5_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22}[ggml_type]
        b = np.ascontiguousarray(blocks).reshape(n, k // 32, size)
        d = _f16(b[..., 0:2])
        codes = _nibbles(b[..., size - 16:])
        out = {"d": d}
        if ggml_type == "Q5_0":
            high = np.unpackbits(np.ascontiguousarray(b[..., 2:6]), axis=-1, bitorder="little")
            codes = codes | (high << 4)
        if ggml_type == "Q4_1":
            out["m"] = _f16(b[..., 2:4])
        out["codes"] = codes.reshape(n, k)
        return out
    b = np.ascontiguousarray(blocks).reshape(n, k // 256, -1)
    if ggml_type in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, m = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(n, k // 256, 4, 32)  # 64-column chunk i: low nibbles, then high nibbles
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k // 256, 8, 32)  # sub-block 2i, 2i+1
        if ggml_type == "Q5_K":
            qh = b[..., 16:48]  # element l of sub-block s: bit s of qh[l]
            bits = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            codes = codes | (bits << 4)
        return {"codes": codes.reshape(n, k), "sc": sc, "m": m, "d": d, "dmin": dmin}
    if ggml_type == "Q6_K":
        ql = b[..., 0:128].reshape(n, k // 256, 2, 64)
        qh = b[..., 128:192].reshape(n, k // 256, 2, 32)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
        d = _f16(b[..., 208:210])
        parts = [(ql[..., :32] & 0x0F) | ((qh & 3) << 4), (ql[..., 32:] & 0x0F) | (((qh >> 2) & 3) << 4),
                 (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
        codes = np.stack(parts, axis=3)  # [n, super-block, half, 4 x 32 columns]
        return {"codes": codes.reshape(n, k), "sc": sc, "d": d}
    raise ValueError(f"no native kernel for {ggml_type}")


def reference_dequantize(fields: dict, ggml_type: str) -> torch.Tensor:
    """The float32 weights decode's fields define, as GGUF's reference dequantization computes them (the
    tests' ground truth beside gguf.quants)."""
    codes = torch.from_numpy(fields["codes"].astype(np.float32))
    n, k = codes.shape
    d = torch.from_numpy(fields["d"].astype(np.float32))
    if ggml_type in ("Q4_0", "Q5_0", "Q4_1"):
        c = codes.reshape(n, k // 32, 32)
        if ggml_type == "Q4_1":
            return (d.unsqueeze(-1) * c + torch.from_numpy(fields["m"].astype(np.float32)).unsqueeze(-1)).reshape(n, k)
        return ((c - (8 if ggml_type == "Q4_0" else 16)) * d.unsqueeze(-1)).reshape(n, k)
    if ggml_type == "Q6_K":
        sc = torch.from_numpy(fields["sc"].astype(np.float32))  # [n, sb, 16]
        c = codes.reshape(n, k // 256, 16, 16)
        return ((d.unsqueeze(-1) * sc).unsqueeze(-1) * (c - 32)).reshape(n, k)
    sc = torch.from_numpy(fields["sc"].astype(np.float32))
    m = torch.from_numpy(fields["m"].astype(np.float32))
    dmin = torch.from_numpy(fields["dmin"].astype(np.float32))
    c = codes.reshape(n, k // 256, 8, 32)
    return ((d.unsqueeze(-1) * sc).unsqueeze(-1) * c - (dmin.unsqueeze(-1) * m).unsqueeze(-1)).reshape(n, k)


def _rows_tiled(v: np.ndarray, tiles: int) -> np.ndarray:
    """[rows, ...] padded with zero rows to tiles * 16 -> [tiles, 16, ...]"""
    pad = tiles * TILE - v.shape[0]
    if pad:
        v = np.concatenate([v, np.zeros((pad, *v.shape[1:]), dtype=v.dtype)])
    return v.reshape(tiles, TILE, *v.shape[1:])


def _code_blocks(codes: np.ndarray, high_bits: int) -> np.ndarray:
    """Codes uint8 [rows, k] -> per tile and 32-block the low-nibble bytes (256) and high-bit words (64 per bit)
    of gguf_tiles.cpp: [tiles, k / 32, 256 + 64 * high_bits]."""
    n, k = codes.shape
    tiles, nb = -(-n // TILE), k // 32
    c = _rows_tiled(codes, tiles).reshape(tiles, TILE, nb, 4, 2, 4)  # tile, lane, block, chunk, part, byte
    low = c & 0x0F
    nib = (low[:, :, :, :, 0, :] | (low[:, :, :, :, 1, :] << 4)).transpose(0, 2, 3, 1, 4).reshape(tiles, nb, 256)
    out = [nib]
    if high_bits:
        h = (c >> 4) & ((1 << high_bits) - 1)
        shifts = (np.arange(4, dtype=np.uint8) * high_bits)[None, None, None, :, None]  # by chunk
        words = [np.bitwise_or.reduce(h[:, :, :, :, part, :] << shifts, axis=3) for part in (0, 1)]
        if high_bits == 1:  # one word: the low part's bits at c, the high part's at 4 + c
            words = [words[0] | (words[1] << 4)]
        out += [w.transpose(0, 2, 1, 3).reshape(tiles, nb, 64) for w in words]
    return np.concatenate(out, axis=2)


def _per_row_bytes(v: np.ndarray, tiles: int) -> np.ndarray:
    """[rows, groups, *per] -> [tiles, groups, *per, 16] bytes (the 16 rows of a tile side by side)."""
    t = _rows_tiled(np.ascontiguousarray(v), tiles)  # [tiles, 16, groups, *per]
    t = np.moveaxis(t, 1, -1)
    return np.ascontiguousarray(t).view(np.uint8).reshape(tiles, v.shape[1], -1)


def tiles(qt) -> tuple[int, torch.Tensor]:
    """A GGUF tensor of NATIVE_TYPES -> (format, its tiles uint8 [tiles, bytes per tile])."""
    n, k = qt.shape
    blocks = qt.blocks if qt.row_permutation is None else qt.blocks[np.asarray(qt.row_permutation)]
    if qt.ggml_type == "Q8_0":
        q, s = linear.q8_0_blocks(qt)
        return INT8, linear.pack("int8", q, s, None, 32).reshape(-(-n // TILE), -1)
    f = decode(blocks, qt.ggml_type, k)
    ntiles = -(-n // TILE)
    if qt.ggml_type in ("Q4_0", "Q4_1"):
        d = torch.from_numpy(f["d"].copy())
        m = torch.from_numpy(f["m"].copy()) if "m" in f else -8 * d
        if not torch.isfinite(m).all():  # -8 d past float16's range: no exact int4 tile
            raise ValueError("Q4_0 scale too large for the int4 tile")
        c = f["codes"].reshape(n, k // 32, 2, 16)
        packed = torch.from_numpy(c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, k // 2)
        return INT4, linear.pack("int4", packed, d, m, 32).reshape(ntiles, -1)
    fmt = {"Q5_0": Q5_0, "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}[qt.ggml_type]
    high = {Q5_0: 1, Q4_K: 0, Q5_K: 1, Q6_K: 2}[fmt]
    blk = _code_blocks(f["codes"], high)  # [tiles, nb, 256 + 64 high]
    if fmt == Q5_0:
        out = np.concatenate([blk, _per_row_bytes(f["d"], ntiles)], axis=2)
    else:
        groups = k // 256
        blk = blk.reshape(ntiles, groups, -1)
        if fmt == Q6_K:
            tail = [_per_row_bytes(f["sc"], ntiles), _per_row_bytes(f["d"], ntiles)]
        else:
            tail = [_per_row_bytes(f["sc"], ntiles), _per_row_bytes(f["m"], ntiles),
                    _per_row_bytes(f["d"], ntiles), _per_row_bytes(f["dmin"], ntiles)]
        out = np.concatenate([blk, *tail], axis=2)
    return fmt, torch.from_numpy(np.ascontiguousarray(out).reshape(ntiles, -1))


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
    out = []
    for i in range(int(header[2])):
        fmt, n, at = (int(v) for v in header[3 + 3 * i:6 + 3 * i])
        size = n * tile_bytes(fmt, int(header[1]))
        out.append((fmt, q[at:at + size].view(n, -1)))
    return out


def tile_bytes(fmt: int, k: int) -> int:
    """Bytes of one tile (16 rows) of k columns."""
    nb = k // 32
    return {INT8: (nb + 1) // 2 * 1088, INT4: nb * 320, Q5_0: nb * 352, Q4_K: k // 256 * 2368,
            Q5_K: k // 256 * 2880, Q6_K: k // 256 * 3360}[fmt]


def segmented_k(q: torch.Tensor) -> int:
    return int(q[:8 * HEADER_INT64].numpy().view(np.int64)[1])


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


def _native_embedding(model: torch.nn.Module, ckpt, tied_head) -> bool:
    """model.model.embed_tokens as a QuantizedEmbedding over the file's blocks (tied_head: the output head
    layer built from the same tensor, whose tiles it then shares). False where the file's table has no
    native format (it stays float)."""
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    qt = ckpt.quantized("model.embed_tokens.weight") if ckpt is not None else None
    if (not isinstance(emb, torch.nn.Embedding) or qt is None or qt.ggml_type not in NATIVE_TYPES
            or tuple(qt.shape) != tuple(emb.weight.shape) or emb.embedding_dim % 32):
        return False
    qweight = tied_head.qweight if tied_head is not None else native_layer(qt, None).qweight
    model.model.embed_tokens = QuantizedEmbedding(qweight, emb.num_embeddings, emb.embedding_dim, emb.weight.dtype)
    return True


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
        if qt is None and tied:  # a head tied to the embedding: the file stores the table once
            qt = ckpt.quantized("model.embed_tokens.weight") if ckpt is not None else None
        with torch.no_grad():
            if qt is not None and qt.ggml_type in NATIVE_TYPES and tuple(qt.shape) == tuple(module.weight.shape):
                new = native_layer(qt, module.bias)
                counts[qt.ggml_type] = counts.get(qt.ggml_type, 0) + 1
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
