"""Paged attention over a flat KV pool.

The pool of one layer is a KVCache (layers/kv_cache.py) of [num_slots, num_kv_heads, head_dim], where
slot = block_id * block_size + offset. The model runner describes each forward pass in an
AttentionMetadata: where the new tokens' K/V go (slot_mapping) and, per sequence, which slots hold its
whole context. Sequences decoding one token are batched into a single padded attention call; sequences
with several new tokens (prefill chunks, speculative verification) are handled one by one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sudu.layers.kv_cache import KVCache


@dataclass
class SeqAttention:
    """One sequence with q_len >= 2 new tokens at the end of a context of ctx_len tokens."""

    q_start: int  # row of its first new token in the flat batch
    q_len: int
    ctx_slots: torch.Tensor  # [ctx_len] slots of positions 0..ctx_len-1 (the new tokens included)
    causal_mask: torch.Tensor | None  # [q_len, ctx_len] True = attend; None -> plain causal from 0
    sliding_mask: torch.Tensor | None  # same, restricted to the sliding window; None if no window


@dataclass
class DecodeBatch:
    """Sequences with exactly one new token, attended together with padding."""

    rows: torch.Tensor  # [B] rows of their tokens in the flat batch
    slots: torch.Tensor  # [B, max_ctx] context slots, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, max_ctx] True = attend
    sliding_mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    seqs: list[SeqAttention] = field(default_factory=list)
    decode: DecodeBatch | None = None
    kv_caches: list[KVCache] = field(default_factory=list)  # per layer


def build_metadata(
    q_lens: list[int],
    ctx_slots: list[torch.Tensor],
    kv_caches: list[KVCache],
    sliding_window: int | None,
) -> AttentionMetadata:
    """q_lens[i] new tokens of sequence i sit at the end of its context, whose slots are ctx_slots[i].
    The new tokens appear in the flat batch in sequence order."""
    slot_parts, seqs, decode_ids = [], [], []
    row = 0
    for i, (q_len, slots) in enumerate(zip(q_lens, ctx_slots)):
        ctx_len = slots.numel()
        slot_parts.append(slots[ctx_len - q_len:])
        if q_len == 1:
            decode_ids.append((i, row))
        else:
            start = ctx_len - q_len
            q_pos = torch.arange(start, ctx_len)[:, None]
            k_pos = torch.arange(ctx_len)[None, :]
            causal = k_pos <= q_pos
            sliding = causal & (q_pos - k_pos < sliding_window) if sliding_window else None
            seqs.append(SeqAttention(row, q_len, slots, None if start == 0 else causal, sliding))
        row += q_len
    decode = None
    if decode_ids:
        max_ctx = max(ctx_slots[i].numel() for i, _ in decode_ids)
        slots = torch.zeros(len(decode_ids), max_ctx, dtype=torch.long)
        mask = torch.zeros(len(decode_ids), max_ctx, dtype=torch.bool)
        sliding = torch.zeros_like(mask) if sliding_window else None
        for b, (i, _) in enumerate(decode_ids):
            n = ctx_slots[i].numel()
            slots[b, :n] = ctx_slots[i]
            mask[b, :n] = True
            if sliding is not None:
                sliding[b, max(0, n - sliding_window):n] = True
        decode = DecodeBatch(
            rows=torch.tensor([r for _, r in decode_ids], dtype=torch.long),
            slots=slots,
            mask=mask[:, None, None, :],
            sliding_mask=None if sliding is None else sliding[:, None, None, :],
        )
    slot_mapping = torch.cat(slot_parts) if slot_parts else torch.zeros(0, dtype=torch.long)
    return AttentionMetadata(slot_mapping=slot_mapping, seqs=seqs, decode=decode, kv_caches=kv_caches)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    meta: AttentionMetadata,
    scale: float,
    sliding: bool,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens. Writes k/v into the layer's pool, attends each
    token to its sequence's context and returns [T, H, D]."""
    cache = meta.kv_caches[layer_idx]
    cache.write(meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    for s in meta.seqs:
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [H, q, D]
        ks, vs = cache.read(s.ctx_slots, q.dtype)  # [ctx, Hkv, D]
        ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)
        mask = s.sliding_mask if sliding and s.sliding_mask is not None else s.causal_mask
        if mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s.q_start:s.q_start + s.q_len] = o.transpose(0, 1)
    d = meta.decode
    if d is not None:
        qd = q.index_select(0, d.rows)[:, :, None, :]  # [B, H, 1, D]
        kd, vd = cache.read(d.slots, q.dtype)  # [B, L, Hkv, D]
        kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)
        mask = d.sliding_mask if sliding and d.sliding_mask is not None else d.mask
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
        out.index_copy_(0, d.rows, o[:, :, 0, :])
    return out
