"""Paged attention over a flat KV pool.

The pool of one layer is a KVCache (layers/kv_cache.py) of [num_slots, num_kv_heads, head_dim], where
slot = block_id * block_size + offset. The model runner describes each forward pass in an
AttentionMetadata: per group of layers (global; sliding-window), where the new tokens' K/V go
(slot_mapping) and, per sequence, which slots hold the keys it may see. Sequences with few new tokens
(decodes, speculative verification, short chunks) are attended together in one call, longer prefill chunks
one by one; both through the native kernels (kernels/attention.cpp), which read keys and values straight
from the pool and compute every query row with one arithmetic: a row's result is the same whichever kernel,
batch, chunking or cache state computes it (docs/exactness.md). Without them (no extension, CUDA, another
pool dtype), and for --fast-math's bfloat16 prompt chunks, SDPA.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sudu import kernels
from sudu.cuda.paged_attention import PagedBatch
from sudu.cuda.paged_attention import paged_attention as paged_kernel
from sudu.layers.kv_cache import NATIVE_POOL_DTYPES, Int8KVCache, KVCache
from sudu.layers.fuse import fuse_linears

NO_SCALES = torch.empty(0)  # a float pool's scales, as the native kernels take them


NATIVE_MAX_Q = 8  # the native kernel takes batches whose sequences have at most this many new tokens
# keys per block of the native kernels (kernels/attention.cpp KB): a sequence's key list starts at a position
# that is a multiple of it (build_view pads it), so blocks sit at the same absolute positions in every call
KEY_BLOCK = 64


def decode_kernel(q: torch.Tensor, cache: KVCache, max_q: int):
    """The native kernel (kernels/attention.cpp) for this call's few-new-token sequences, or None: it takes
    float32 queries over a pool it reads (NATIVE_POOL_DTYPES) with a head size that is a multiple of 8, and batches
    whose longest sequence has at most NATIVE_MAX_Q new tokens (decodes and speculative verification;
    beyond that, e.g. a prefill chunk riding along with decodes, SDPA's blocked kernel is faster).
    Otherwise (or without the extension) they go through index_select + SDPA."""
    if (not q.is_cpu or q.dtype != torch.float32 or cache.k.dtype not in NATIVE_POOL_DTYPES
            or q.shape[-1] % 8 or max_q > NATIVE_MAX_Q):
        return None
    ext = kernels.load()
    return None if ext is None else ext.decode_attention


class QKVProjections:
    """Mixin for attention modules with q_proj, k_proj and v_proj reading the same input; after loading,
    fuse_projections() replaces them with one qkv_proj (one call instead of three)."""

    def fuse_projections(self) -> None:
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[T, (heads + 2 * kv_heads) * head_dim]: q, k and v side by side."""
        fused = getattr(self, "qkv_proj", None)  # not a class attribute: nn.Module keeps submodules apart
        if fused is not None:
            return fused(x)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


@dataclass
class SeqAttention:
    """One sequence with q_len >= 2 new tokens at the end of its context."""

    q_start: int  # row of its first new token in the flat batch
    q_len: int
    key_slots: torch.Tensor  # slots of the keys it may see, in position order (the new tokens included)
    mask: torch.Tensor | None  # [q_len, num_keys] True = attend; None -> plain causal from position 0
    # the same mask as the native prompt kernel takes it: new token i sees key j where j <= first + i and,
    # with a window (> 0), first + i - j < window
    first: int = 0
    window: int = 0
    # rows that are an image's tokens in a model whose images attend both ways (Gemma 3): they see up to their
    # image's last position, which `mask` says and the native path computes as a few-row batch after the chunk
    image_rows: DecodeBatch | None = None

    def to(self, device: torch.device) -> SeqAttention:
        mask = None if self.mask is None else self.mask.to(device, non_blocking=True)
        rows = None if self.image_rows is None else self.image_rows.to(device)
        return SeqAttention(self.q_start, self.q_len, self.key_slots.to(device, non_blocking=True), mask,
                            self.first, self.window, rows)


@dataclass
class DecodeBatch:
    """Sequences with few new tokens (decodes: 1; speculative verification: 1 + drafts; short chunks),
    attended together in one padded call."""

    rows: torch.Tensor  # [B, max_q] rows of their new tokens in the flat batch, -1 = padding
    slots: torch.Tensor  # [B, max_keys] key slots, padded with slot 0
    mask: torch.Tensor  # [B, 1, max_q, max_keys] True = attend (padding queries see key 0, never NaN)
    padded: bool = False  # some rows are -1 (sequences with fewer new tokens than max_q)

    def to(self, device: torch.device) -> DecodeBatch:
        return DecodeBatch(*(t.to(device, non_blocking=True) for t in (self.rows, self.slots, self.mask)), self.padded)


@dataclass
class AttentionView:
    """The batch as one group of layers sees it: global layers see every position, sliding-window
    layers only the window (through their own ring of slots, or the same slots under a window mask)."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    seqs: list[SeqAttention] = field(default_factory=list)
    decode: DecodeBatch | None = None
    # the CUDA path (sudu/cuda/): every sequence through the block-table kernel instead of seqs / decode
    paged: PagedBatch | None = None

    def to(self, device: torch.device) -> AttentionView:
        return AttentionView(self.slot_mapping.to(device, non_blocking=True), [s.to(device) for s in self.seqs],
                             None if self.decode is None else self.decode.to(device),
                             None if self.paged is None else self.paged.to(device))


# sequences with at most this many new tokens share one padded attention call: the native kernel's limit, so
# that every such sequence takes the kernel whatever else is in the step (a longer one in the batch would
# send them all through SDPA, whose sums differ in the last bits: speculative and constrained decoding
# rely on a row computing the same in any step)
SMALL_Q = NATIVE_MAX_Q


@dataclass
class AttentionMetadata:
    full: AttentionView
    sliding: AttentionView | None  # None: the model has no sliding-window layers
    kv_caches: list[KVCache] = field(default_factory=list)  # per layer
    # the element type the prompt chunks' SDPA runs in (None: the queries'): bfloat16 in a step whose
    # linears run as bfloat16 GEMMs (layers/linear.py prefill_attention_dtype): the flash kernel is faster
    # there than in float32 (docs/cpu_speed.md) and rounds no coarser than those GEMMs' inputs
    sdpa_dtype: torch.dtype | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same batch with its index tensors on device (built on the host, copied once per step; the
        pools stay where they are)."""
        return AttentionMetadata(self.full.to(device), None if self.sliding is None else self.sliding.to(device),
                                 self.kv_caches, self.sdpa_dtype)


def widen_to_images(mask: torch.Tensor, spans: list[tuple[int, int]], q0: int, k0: int) -> None:
    """mask [q, keys] (True = attend) of new tokens at positions q0.. over keys at positions k0..: a token of an
    image span [a, b) also sees the keys after it up to b - 1 (the image's own tokens, both ways). Its lower
    bound (the window) stays."""
    for a, b in spans:
        for p in range(max(a, q0), min(b, q0 + mask.shape[0])):
            mask[p - q0, p - k0 + 1:b - k0] = True


def image_batch(q_start: int, q0: int, k0: int, slots: torch.Tensor, spans: list[tuple[int, int]],
                window: int | None, rows_per_item: int = 16) -> DecodeBatch | None:
    """The image tokens among a prompt chunk (its first new token at position q0, flat row q_start; keys from
    position k0 in slots) as a few-row batch for the native decode kernel, each row over its own span of keys:
    from its window's start (or the list's) to its image's last position. The kernel computes a row by the
    prompt kernel's recipe, so such a row is computed as any row that sees those keys."""
    positions = [p for a, b in spans for p in range(max(a, q0), b)]
    if not positions:
        return None
    ends = [b for a, b in spans for _ in range(max(a, q0), b)]
    n, width = len(positions), slots.numel()
    items = -(-n // rows_per_item)
    pos = torch.full((items * rows_per_item,), -1, dtype=torch.long)
    pos[:n] = torch.tensor(positions)
    end = torch.zeros(items * rows_per_item, dtype=torch.long)
    end[:n] = torch.tensor(ends)
    valid = pos >= 0
    k_pos = torch.arange(width) + k0
    mask = (k_pos[None, :] < end[:, None]) & valid[:, None]
    if window:
        mask &= k_pos[None, :] > pos[:, None] - window
    mask[:, 0] |= ~valid  # padding rows see key 0, never NaN
    rows = torch.where(valid, pos - q0 + q_start, -1).view(items, rows_per_item)
    return DecodeBatch(rows, slots[None].expand(items, width).contiguous(), mask.view(items, 1, rows_per_item, width),
                       padded=n < items * rows_per_item)


def build_view(q_lens: list[int], ctx_lens: list[int], key_starts: list[int], key_slots: list[torch.Tensor],
               window: int | None, image_spans: list[list[tuple[int, int]]] | None = None) -> AttentionView:
    """Sequence i has q_lens[i] new tokens at the end of ctx_lens[i] positions and sees the keys at
    positions key_starts[i]..ctx_lens[i]-1, held in key_slots[i]. A key list that starts past position 0 (a
    sliding window's own pool: only with window set, whose mask hides every earlier position) is padded at
    its front with slot 0 back to a multiple of KEY_BLOCK. image_spans[i]: the position spans [a, b) of the
    images whose tokens attend both ways among this step's new tokens (each within the context: b <=
    ctx_lens[i], the scheduler never ends a chunk inside an image)."""
    slot_parts, seqs, small, small_rows = [], [], [], []
    spans_of = image_spans or [[] for _ in q_lens]
    key_starts, key_slots = list(key_starts), list(key_slots)
    row = 0
    for i, (q_len, k0, slots) in enumerate(zip(q_lens, key_starts, key_slots)):
        slot_parts.append(slots[slots.numel() - q_len:])
        if k0 % KEY_BLOCK:
            assert window, "a key list that does not start at position 0 needs a window mask over its padding"
            pad = k0 % KEY_BLOCK
            key_slots[i] = torch.cat([torch.zeros(pad, dtype=slots.dtype), slots])
            key_starts[i] = k0 - pad
    for i, (q_len, ctx_len, k0, slots) in enumerate(zip(q_lens, ctx_lens, key_starts, key_slots)):
        if q_len <= SMALL_Q:
            small.append(i)
            small_rows.append(row)
        else:
            start = ctx_len - q_len
            spans = spans_of[i]
            plain_causal = start == 0 and k0 == 0 and not (window and ctx_len > window) and not spans
            mask = None
            if not plain_causal:
                q_pos = torch.arange(start, ctx_len)[:, None]
                k_pos = torch.arange(k0, ctx_len)[None, :]
                mask = k_pos <= q_pos
                if window:
                    mask &= q_pos - k_pos < window
                widen_to_images(mask, spans, start, k0)
            wide = image_batch(row, start, k0, slots, spans, window) if spans else None
            seqs.append(SeqAttention(row, q_len, slots, mask, start - k0, window or 0, wide))
        row += q_len
    decode = (_decode_batch(small, small_rows, q_lens, ctx_lens, key_starts, key_slots, window, spans_of)
              if small else None)
    slot_mapping = torch.cat(slot_parts) if slot_parts else torch.zeros(0, dtype=torch.long)
    return AttentionView(slot_mapping, seqs, decode)


def _decode_batch(small: list[int], first_rows: list[int], q_lens: list[int], ctx_lens: list[int],
                  key_starts: list[int], key_slots: list[torch.Tensor], window: int | None,
                  image_spans: list[list[tuple[int, int]]]) -> DecodeBatch:
    """The few-new-token sequences `small` as one padded batch, built with a fixed number of tensor ops
    whatever the batch size (per-step host work: it runs every decode step)."""
    # per sequence: new tokens, keys, first key's position, first new token's position, its row
    info = torch.tensor([[q_lens[i], key_slots[i].numel(), key_starts[i], ctx_lens[i] - q_lens[i], r]
                         for i, r in zip(small, first_rows)])
    max_q = max(q_lens[i] for i in small)
    padded = any(q_lens[i] < max_q for i in small)
    if len(small) == 1:
        slots = key_slots[small[0]][None]
    else:  # padding: slot 0
        slots = torch.nn.utils.rnn.pad_sequence([key_slots[i] for i in small], batch_first=True)
    cols = torch.arange(slots.shape[1])
    k_pos = info[:, 2:3] + cols  # [B, width]
    if max_q == 1:  # decodes: the one new token is the last position, so it sees every key it has
        mask = cols < info[:, 1:2]
        if window:
            mask &= info[:, 3:4] - k_pos < window
        return DecodeBatch(info[:, 4:5].clone(), slots, mask[:, None, None, :])
    j = torch.arange(max_q)
    q_pos = (info[:, 3:4] + j)[:, :, None]  # [B, max_q, 1]
    valid_q = j < info[:, 0:1]  # [B, max_q]
    mask = (k_pos[:, None, :] <= q_pos) & (cols < info[:, 1:2])[:, None, :] & valid_q[:, :, None]
    if window:
        mask &= q_pos - k_pos[:, None, :] < window
    for b, i in enumerate(small):
        if image_spans[i]:
            widen_to_images(mask[b], image_spans[i], ctx_lens[i] - q_lens[i], key_starts[i])
    mask[:, :, 0] |= ~valid_q  # padding queries see key 0, never NaN
    rows = torch.where(valid_q, info[:, 4:5] + j, -1)
    return DecodeBatch(rows, slots, mask[:, None], padded=padded)


def build_metadata(
    q_lens: list[int],
    ctx_slots: list[torch.Tensor],
    kv_caches: list[KVCache],
    sliding_window: int | None,
    sliding_keys: list[tuple[int, torch.Tensor]] | None = None,
    sdpa_dtype: torch.dtype | None = None,
    image_spans: list[list[tuple[int, int]]] | None = None,
) -> AttentionMetadata:
    """q_lens[i] new tokens of sequence i sit at the end of its context, whose slots are ctx_slots[i].
    With sliding_window set, sliding layers read either their own pool (sliding_keys[i] = (first
    position kept, slots from there on)) or, without it, the same slots under a window mask. image_spans:
    per sequence, the spans of images whose tokens attend both ways (build_view)."""
    ctx_lens = [s.numel() for s in ctx_slots]
    full = build_view(q_lens, ctx_lens, [0] * len(q_lens), ctx_slots, None, image_spans)
    sliding = None
    if sliding_window:
        if sliding_keys is None:
            sliding = build_view(q_lens, ctx_lens, [0] * len(q_lens), ctx_slots, sliding_window, image_spans)
        else:
            sliding = build_view(q_lens, ctx_lens, [k0 for k0, _ in sliding_keys], [s for _, s in sliding_keys],
                                 sliding_window, image_spans)
    return AttentionMetadata(full, sliding, kv_caches, sdpa_dtype)


def prompt_kernel(q: torch.Tensor, cache: KVCache, dtype: torch.dtype):
    """The native prompt-chunk kernel (kernels/attention.cpp prompt_attention: the decode kernel's arithmetic),
    or None: it takes float32 queries on the CPU whose head size (K's and V's alike) is a multiple of 8, over
    a pool it reads (the decode kernel's conditions). --fast-math's bfloat16 chunks (dtype) take SDPA's flash
    kernel on the CPU's bfloat16 units, unless the pool's attention already runs on the bfloat16 tiles, which
    are faster."""
    if (not q.is_cpu or q.dtype != torch.float32 or (dtype != torch.float32 and not cache.bf16_tiles)
            or q.shape[-1] % 8
            or cache.k.dtype not in NATIVE_POOL_DTYPES
            or cache.k.shape[-1] != q.shape[-1] or cache.v.shape[-1] != q.shape[-1]):
        return None
    ext = kernels.load()
    return None if ext is None else ext.prompt_attention


def _expand_heads(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., kv_heads, keys, D] -> [..., num_heads, keys, D], each kv head repeated for its query heads.
    In float32, SDPA's own enable_gqa=True is slower on CPU (torch 2.13) than its fused kernel on expanded heads."""
    groups = num_heads // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


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
    view = meta.sliding if sliding and meta.sliding is not None else meta.full
    cache = meta.kv_caches[layer_idx]
    cache.write(view.slot_mapping, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if view.paged is not None:
        scales = (cache.k_scale, cache.v_scale) if isinstance(cache, Int8KVCache) else (None, None)
        return paged_kernel(q, cache.k, cache.v, view.paged, scale, out, *scales)
    dtype = meta.sdpa_dtype or q.dtype
    native = prompt_kernel(q, cache, dtype) if view.seqs else None
    pool_scales = (cache.k_scale, cache.v_scale) if isinstance(cache, Int8KVCache) else (NO_SCALES, NO_SCALES)
    for s in view.seqs:
        if native is not None:
            native(q[s.q_start:s.q_start + s.q_len], cache.k, cache.v, *pool_scales, s.key_slots,
                   out[s.q_start:s.q_start + s.q_len], s.first, s.window, scale, cache.bf16_tiles)
            if s.image_rows is not None:  # an image's rows again, each seeing up to its image's end
                d = s.image_rows
                kernels.load().decode_attention(q, cache.k, cache.v, *pool_scales, d.rows, d.slots, d.mask[:, 0],
                                                scale, out, cache.bf16_tiles)
            continue
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1).to(dtype)  # [H, q, D]
        ks, vs = cache.read(s.key_slots, dtype)  # [keys, Hkv, D]
        ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)
        gqa = dtype != q.dtype  # bfloat16: SDPA's own grouped heads (faster there than expanded copies)
        if not gqa:
            ks, vs = _expand_heads(ks, qs.shape[0]), _expand_heads(vs, qs.shape[0])
        causal = s.mask is None
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=s.mask, is_causal=causal,
                                           scale=scale, enable_gqa=gqa)[0]
        out[s.q_start:s.q_start + s.q_len] = o.transpose(0, 1)
    d = view.decode
    kernel = decode_kernel(q, cache, d.rows.shape[1]) if d is not None else None
    if kernel is not None:
        kernel(q, cache.k, cache.v, *pool_scales, d.rows, d.slots, d.mask[:, 0], scale, out, cache.bf16_tiles)
    elif d is not None:
        B, max_q = d.rows.shape
        qd = q.index_select(0, d.rows.reshape(-1).clamp_min(0)).view(B, max_q, *q.shape[1:]).transpose(1, 2)
        kd, vd = cache.read(d.slots, q.dtype)  # [B, L, Hkv, D]
        kd, vd = _expand_heads(kd.transpose(1, 2), q.shape[1]), _expand_heads(vd.transpose(1, 2), q.shape[1])
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scale)
        o = o.transpose(1, 2).reshape(B * max_q, *q.shape[1:])
        if not d.padded:
            out.index_copy_(0, d.rows.reshape(-1), o)
        else:
            valid = d.rows.reshape(-1) >= 0
            out.index_copy_(0, d.rows.reshape(-1)[valid], o[valid])
    return out
