"""Paged attention for the CUDA path: one Triton kernel that reads K/V straight from the pool through each
sequence's block table on the device, with no gather copy.

One varlen kernel serves every step: sequence b has q_len_b new tokens at the end of its seq_len_b positions
(decode: 1; speculative verification: 1 + drafts; prefill and mixed chunks: many), its rows laid out from
query_start[b] in the flat batch. Position p of sequence b lives in slot block_tables[b, p // block_size] *
block_size + p % block_size. A program takes one sequence, one tile of its new tokens and one KV head, and
the tile's rows are (token, query head of that KV head's group) pairs, so GQA reads each key once for the
whole group. Keys are visited in tiles aligned at absolute positions (multiples of BLOCK_N), masked by
causality, the sequence's length and the sliding window, with an online softmax whose running maximum starts
finite: a tile that is wholly masked for a row leaves that row's state exactly as it was, so a row's result
does not depend on which other rows share its program (the batch-invariance speculative decoding needs), as
long as the tile shapes are the same. They are: sequences with at most SMALL_Q_TILE new tokens always take the
small tile, in a launch of their own, whatever else is in the step; longer ones take the large tile in a
second launch (each launch's programs skip the other kind's sequences).

int8 pools (layers/kv_cache.py Int8KVCache) have one scale per (KV head, channel): K's scales are folded into
the queries (q . (s * k) = (q * s) . k) and V's applied to the output, so the codes are read as they are.
Sliding-window layers pass their window; a ring pool (SlidingWindowBlocks) is the same table with released
blocks marked -1, which the window keeps the kernel from reading.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sudu.cuda import interpreted

SMALL_Q_TILE = 8  # sequences with at most this many new tokens (decodes, verification) share one tile shape
LARGE_Q_ROWS = 128  # rows of a prefill tile (tokens x group heads, rounded to a power of two)
BLOCK_N = 32  # keys per inner tile


@dataclass
class PagedBatch:
    """The step's sequences as the kernel reads them (all on the pool's device)."""

    block_tables: torch.Tensor  # int32 [B, max_blocks]; -1 where a block is absent (a ring's released blocks)
    seq_lens: torch.Tensor  # int32 or int64 [B] positions each sequence has after this step
    query_start: torch.Tensor  # int32 [B + 1] first row of each sequence's new tokens in the flat batch
    max_q_len: int  # the most new tokens of one sequence (picks the tile shape and the grid)
    block_size: int  # positions per block
    window: int = 0  # 0: every earlier position; w: only the last w positions (sliding-window layers)

    def to(self, device: torch.device) -> PagedBatch:
        return PagedBatch(*(t.to(device, non_blocking=True) for t in (self.block_tables, self.seq_lens, self.query_start)),
                          self.max_q_len, self.block_size, self.window)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_shape(large: bool, group: int, float32: bool) -> tuple[int, int]:
    """(tokens per tile, rows per tile) for sequences with at most SMALL_Q_TILE new tokens (large False) or more,
    with `group` query heads per KV head. Rows are at least 16 (tl.dot's smallest) and a power of two; float32
    tiles take half the rows (their products need the registers 16-bit ones do not)."""
    if not large:
        tokens = SMALL_Q_TILE
    else:
        tokens = max(SMALL_Q_TILE, (LARGE_Q_ROWS // (2 if float32 else 1)) // _next_pow2(group))
    return tokens, max(16, _next_pow2(tokens * group))


@functools.lru_cache(maxsize=None)
def _kernel():
    """The Triton kernel, defined on first use (TRITON_INTERPRET is read when it is defined)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
        block_size,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, Q_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, INT8: tl.constexpr, IEEE: tl.constexpr, LARGE: tl.constexpr, SMALL_Q: tl.constexpr,
    ):
        b = tl.program_id(0)
        tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_begin = tl.load(query_start_ptr + b)
        q_len = tl.load(query_start_ptr + b + 1) - q_begin
        seq_len = tl.load(seq_lens_ptr + b)
        if LARGE:  # this launch's kind of sequence (module docstring)
            mine = q_len > SMALL_Q
        else:
            mine = q_len <= SMALL_Q
        if mine & (tile * Q_TOKENS < q_len):
            m = tl.arange(0, BLOCK_M)
            tok = tile * Q_TOKENS + m // GROUP
            head = kv_head * GROUP + m % GROUP
            row_ok = (m < Q_TOKENS * GROUP) & (tok < q_len)
            q_pos = seq_len - q_len + tok  # [BLOCK_M]
            d = tl.arange(0, BLOCK_D)
            dv = tl.arange(0, BLOCK_DV)
            q = tl.load(q_ptr + (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
            if INT8:
                ks = tl.load(k_scale_ptr + kv_head * HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0)
                q = q * ks[None, :]
            q = q * scale
            if IEEE:
                qd = q
            else:
                qd = q.to(q_ptr.dtype.element_ty)  # bfloat16 or float16: the model's own 16-bit type
            m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            first_pos = seq_len - q_len + tile * Q_TOKENS  # the tile's earliest query
            last_pos = tl.minimum(first_pos + Q_TOKENS, seq_len) - 1
            lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
            lo = (lo // BLOCK_N) * BLOCK_N  # absolute alignment: the same key tiles for a row in any program
            for start in range(lo, last_pos + 1, BLOCK_N):
                keys = start + tl.arange(0, BLOCK_N)
                key_ok = keys <= last_pos
                block = tl.load(block_tables_ptr + b * stride_bt + keys // block_size, mask=key_ok, other=0)
                key_ok = key_ok & (block >= 0)
                slot = block.to(tl.int64) * block_size + keys % block_size
                k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                            mask=key_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
                if IEEE:
                    s = tl.dot(qd, tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(qd, tl.trans(k.to(tl.float32).to(q_ptr.dtype.element_ty)))
                see = key_ok[None, :] & (keys[None, :] <= q_pos[:, None]) & row_ok[:, None]
                see = see & ((window <= 0) | (q_pos[:, None] - keys[None, :] < window))
                s = tl.where(see, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
                            mask=key_ok[:, None] & (dv[None, :] < V_DIM), other=0.0)
                if IEEE:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(q_ptr.dtype.element_ty), v.to(tl.float32).to(q_ptr.dtype.element_ty))
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            if INT8:
                vs = tl.load(v_scale_ptr + kv_head * V_DIM + dv, mask=dv < V_DIM, other=0.0)
                acc = acc * vs[None, :]
            tl.store(out_ptr + (q_begin + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < V_DIM))

    return paged_attention_kernel


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch,
                    scale: float, out: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] every sequence's new tokens, flat; k_pool / v_pool: [slots, Hkv, D | Dv] (float, or int8
    with k_scale / v_scale [Hkv, D | Dv]); out: [T, H, Dv], written in place and returned. The new tokens'
    K/V must be in the pool already."""
    T, H, D = q.shape
    Hkv, Dv = k_pool.shape[1], v_pool.shape[2]
    if H % Hkv:
        raise ValueError(f"{H} query heads do not split over {Hkv} KV heads")
    B = batch.seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    group = H // Hkv
    int8 = k_pool.dtype == torch.int8
    if int8 and (k_scale is None or v_scale is None):
        raise ValueError("an int8 pool needs its K and V scales")
    # float32 steps (--dtype float32) keep float32 products, not TF32; Triton's interpreter computes 16-bit dot
    # products wrongly, so there every product is float32 (the loads and stores keep their dtypes)
    ieee = q.dtype == torch.float32 or interpreted()
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("paged attention needs the head dimension contiguous")
    dummy = q.new_empty(0, dtype=torch.float32)
    launches = [False] if batch.max_q_len <= SMALL_Q_TILE else [False, True]
    for large in launches:
        q_tokens, rows = tile_shape(large, group, q.dtype == torch.float32)
        longest = SMALL_Q_TILE if not large else batch.max_q_len
        _kernel()[(B, -(-longest // q_tokens), Hkv)](
            q, k_pool, v_pool, out,
            k_scale if int8 else dummy, v_scale if int8 else dummy,
            batch.block_tables, batch.seq_lens, batch.query_start,
            float(scale), int(batch.window),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), batch.block_tables.stride(0),
            batch.block_size,
            GROUP=group, HEAD_DIM=D, V_DIM=Dv, BLOCK_D=max(16, _next_pow2(D)), BLOCK_DV=max(16, _next_pow2(Dv)),
            Q_TOKENS=q_tokens, BLOCK_M=rows, BLOCK_N=BLOCK_N, INT8=int8, IEEE=ieee, LARGE=large,
            SMALL_Q=SMALL_Q_TILE,
            num_warps=4 if rows <= 64 else 8,  # a prefill tile's float32 accumulator spread over more threads
        )
    return out
