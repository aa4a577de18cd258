"""The int8 / int4 weight formats' math, below every layer: quantization in groups of 32 (int8: w = s * q; int4:
w = s * q + m), dequantization, the tiles of 16 rows the native kernels read (pack / unpack; kernels/quant_linear.cpp
explains the layouts) and a GGUF Q8_0 tensor's blocks as int8. Plain tensor functions: the layers that run these
formats (layers/linear.py, the CUDA path's cuda/quant_linear.py) and the model surgery (engine/network.py) use them."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

FORMATS = ("int8", "int4")
GROUP_SIZE = 32


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
