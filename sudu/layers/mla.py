"""Multi-head latent attention (DeepSeek-V2/V3) over a paged pool of compressed entries.

Each token stores one entry per layer, shared by all heads: the compressed latent c (kv_lora_rank values,
after kv_a_layernorm) and the rotary key part k_pe (qk_rope_head_dim values, after RoPE). The pool is an
ordinary KVCache of one head whose K is k_pe and whose V is c (ModelConfig.kv_cache_shape), so int8 KV,
prefix caching and the block tables work unchanged. Full K/V would be heads * (qk_nope + qk_rope + v_head)
values per token; the entry is kv_lora_rank + qk_rope_head_dim.

Attention runs in the absorbed form for every token, prefill and decode alike: with kv_b_proj split per head
into W_UK [qk_nope, lora] and W_UV [v_head, lora], a head's score q_nope . (W_UK c) + q_pe . k_pe equals
(W_UK^T q_nope) . c + q_pe . k_pe, and its output W_UV (sum_j p_j c_j). So the queries are mapped into
latent space once per token, all heads attend over the same [c ; k_pe] keys with c as the values (one
attention head of heads x new-token query rows), and W_UV maps each head's latent output back. No
per-head key or value is ever built for the context.

With the native kernels, both steps keep a row's numbers independent of what is computed with it
(docs/exactness.md): the per-head products run as one multiply-add chain per output (kernels/latent.cpp
head_matmul) and the attention through the paged kernels' row recipe (kernels/attention.cpp) over the
sequence's gathered [c ; k_pe] keys. Without them, torch.bmm and SDPA, whose sums depend on the row count.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sudu import kernels
from sudu.layers.attention import NO_SCALES, AttentionMetadata
from sudu.layers.kv_cache import KVCache
from sudu.layers.fuse import fuse_linears
from sudu.layers.linear import FloatWeight
from sudu.layers.norm import RMSNorm
from sudu.layers.rotary import apply_rotary, yarn_mscale
from sudu.layers.sparse_index import LightningIndexer, attend_selected, top_k_keys

if TYPE_CHECKING:
    from sudu.model_config import ModelConfig


# The query and key/value latents are normalized with RMSNorm's default eps in DeepSeek's own code and in
# transformers, whatever config.json's rms_norm_eps (which the decoder's norms use) says
LATENT_NORM_EPS = 1e-6


def _fold_heads_mask(mask: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., q, keys] -> [..., heads * q, keys]: query row h * q + j is head h's j-th new token."""
    return mask.unsqueeze(-3).expand(*mask.shape[:-2], heads, *mask.shape[-2:]).flatten(-3, -2)


SPARSE_PROMPT_ROWS = 64  # a prompt's rows ranked and attended together (each gathers index_topk keys)


def sparse_rows(q, index, cache: KVCache, key_slots, mask, q_start: int, scale: float, rope: int, out) -> None:
    """DeepSeek Sparse Attention for one sequence's new rows (q rows q_start.., mask [rows, keys]): every key's
    index key read and ranked, then only the chosen keys' latents read and attended, SPARSE_PROMPT_ROWS rows
    at a time."""
    iq, iw, topk = index
    lora = cache.v.shape[-1]
    k_all = cache.read_k(key_slots, q.dtype)[:, 0]  # [keys, rope + index]
    for start in range(0, mask.shape[0], SPARSE_PROMPT_ROWS):
        rows = slice(q_start + start, q_start + min(start + SPARSE_PROMPT_ROWS, mask.shape[0]))
        order, valid = top_k_keys(iq[rows], iw[rows], k_all[:, rope:], mask[start:start + SPARSE_PROMPT_ROWS], topk)
        chosen_k, chosen_c = cache.read(key_slots[order], q.dtype)  # [r, topk, 1, .]
        keys = torch.cat([chosen_c, chosen_k[..., :rope]], dim=-1)[:, :, 0]
        out[rows] = attend_selected(q[rows], keys, valid, scale, lora)


def head_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] @ w [H, K, N] per head -> [T, H, N]; natively one fused multiply-add chain per output."""
    ext = kernels.load()
    if ext is not None and x.is_cpu and x.dtype == w.dtype == torch.float32 and w.shape[-1] % 8 == 0:
        return ext.head_matmul(x, w.contiguous())
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def latent_keys(cache: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The keys [c ; k_pe] of the entries at slots (any shape), as [slots.numel(), 1, lora + rope]."""
    k_pe, c = cache.read(slots.reshape(-1), dtype)
    return torch.cat([c, k_pe], dim=-1)


def native_latent_attention(q: torch.Tensor, cache: KVCache, view, scale: float) -> torch.Tensor | None:
    """Dense latent attention through the native paged kernels (the row recipe of kernels/attention.cpp),
    each sequence over its gathered keys with the keys as values (the rotary columns of the output are
    dropped), or None where they cannot take it (no extension, not float32 on the CPU, a width that is not a
    multiple of 8). The full view's key lists start at position 0, so the gathered keys' blocks sit at their
    absolute positions as the kernels require."""
    ext = kernels.load()
    if ext is None or not q.is_cpu or q.dtype != torch.float32 or q.shape[-1] % 8:
        return None
    out = torch.empty_like(q)
    for s in view.seqs:
        keys = latent_keys(cache, s.key_slots, q.dtype)
        rows = slice(s.q_start, s.q_start + s.q_len)
        ext.prompt_attention(q[rows], keys, keys, NO_SCALES, NO_SCALES, torch.arange(keys.shape[0]), out[rows],
                             s.first, 0, scale, False)
    d = view.decode
    if d is not None:
        keys = latent_keys(cache, d.slots, q.dtype)
        slots = torch.arange(keys.shape[0]).view(d.slots.shape)
        ext.decode_attention(q, keys, keys, NO_SCALES, NO_SCALES, d.rows, slots, d.mask[:, 0], scale, out, False)
    return out[..., :cache.v.shape[-1]]


def latent_attention(q: torch.Tensor, cache: KVCache, view, scale: float, index=None) -> torch.Tensor:
    """q: [T, H, kv_lora_rank + rope] (latent-space queries, rotary part last) for the new tokens, whose
    entries are already in the pool. Returns each head's latent output [T, H, kv_lora_rank].

    The values passed to SDPA are the keys themselves ([c ; k_pe]) and the rotary columns of the output are
    dropped: SDPA's fused CPU kernel needs values as wide as keys, and this costs no copy.

    index: DeepSeek Sparse Attention's (queries [T, heads, dim], weights [T, heads], top-k) from
    LightningIndexer; the pool's K then holds [k_pe ; index key], and every query row, prompt or decode,
    attends over the top-k keys top_k_keys picks for it, gathered (layers/sparse_index.py)."""
    if index is None:
        native = native_latent_attention(q, cache, view, scale)
        if native is not None:
            return native
    T, H, D = q.shape
    lora = cache.v.shape[-1]
    rope = D - lora
    out = q.new_empty(T, H, lora)
    for s in view.seqs:
        mask = s.mask
        if mask is None:  # plain causal from position 0: the new tokens are the whole context
            mask = torch.ones(s.q_len, s.q_len, dtype=torch.bool, device=q.device).tril()
        if index is not None:
            sparse_rows(q, index, cache, s.key_slots, mask, s.q_start, scale, rope, out)
            continue
        keys = latent_keys(cache, s.key_slots, q.dtype)[:, 0]
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1).reshape(1, 1, H * s.q_len, D)
        o = F.scaled_dot_product_attention(qs, keys[None, None], keys[None, None],
                                           attn_mask=_fold_heads_mask(mask, H), scale=scale)
        out[s.q_start:s.q_start + s.q_len] = o[..., :lora].view(H, s.q_len, lora).transpose(0, 1)
    d = view.decode
    if d is not None:
        B, max_q = d.rows.shape
        if index is not None:
            iq, iw, topk = index
            flat = d.rows.reshape(-1).clamp_min(0)
            k_all = cache.read_k(d.slots, q.dtype)  # [B, keys, 1, rope + index]: every key ranked, latents read
            # for the chosen ones only
            order, chosen_valid = top_k_keys(iq.index_select(0, flat).view(B, max_q, *iq.shape[1:]),
                                             iw.index_select(0, flat).view(B, max_q, -1), k_all[:, :, 0, rope:],
                                             d.mask[:, 0], topk)
            chosen_k, chosen_c = cache.read(d.slots.gather(1, order.flatten(1)), q.dtype)  # [B, max_q * topk, 1, .]
            chosen = torch.cat([chosen_c, chosen_k[..., :rope]], dim=-1)[:, :, 0].view(B * max_q, topk, D)
            o = attend_selected(q.index_select(0, flat), chosen, chosen_valid.flatten(0, 1), scale, lora)
        else:
            qd = q.index_select(0, d.rows.reshape(-1).clamp_min(0)).view(B, max_q, H, D)
            qd = qd.transpose(1, 2).reshape(B, 1, H * max_q, D)
            keys = latent_keys(cache, d.slots, q.dtype).view(*d.slots.shape, D)
            # a batch without padding (e.g. one decoding sequence) needs no mask, and SDPA's fused kernel
            # takes it without one
            mask = None if bool(d.mask.all()) else _fold_heads_mask(d.mask, H)
            o = F.scaled_dot_product_attention(qd, keys[:, None], keys[:, None], attn_mask=mask, scale=scale)
            o = o[..., :lora].reshape(B, H, max_q, lora).transpose(1, 2).reshape(B * max_q, H, lora)
        rows = d.rows.reshape(-1)
        if d.padded:
            valid = rows >= 0
            rows, o = rows[valid], o[valid]
        out.index_copy_(0, rows, o)
    return out


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1), (x2, x3), ... pairs -> (x0, x2, ... | x1, x3, ...): DeepSeek's interleaved rotary pairs in
    the rotate-half layout. Applied to queries and keys alike, it leaves every score unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """DeepSeek's attention block under its Hugging Face names: q_a_proj / q_a_layernorm / q_b_proj (or q_proj
    without a query rank), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        H = self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_head, self.lora = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                                        cfg.kv_lora_rank)
        qk = self.nope + self.rope
        bias = cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.lora + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.lora, LATENT_NORM_EPS)
        self.kv_b_proj = FloatWeight(H * (self.nope + self.v_head), self.lora)  # split per head, never quantized
        # DeepSeek Sparse Attention (V3.2): each query attends to the tokens the indexer ranks best
        self.indexer = LightningIndexer(cfg) if cfg.index_topk else None
        self.o_proj = nn.Linear(H * self.v_head, cfg.hidden_size, bias=bias)
        self.interleaved = cfg.rope_interleave
        # kv_b_proj split per head, set by fuse_projections (buffers: they move with the network to a device)
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self.qkv_a_proj = None  # q_a_proj and kv_a_proj_with_mqa in one call, set by fuse_projections
        self.scale = qk ** -0.5
        yarn = cfg.rope_yarn or {}
        if yarn.get("mscale_all_dim"):
            self.scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2

    def fuse_projections(self) -> None:
        """After loading (and quantizing): the per-head halves of kv_b_proj as contiguous matrices, W_UK
        [heads, qk_nope, lora] and W_UV^T [heads, lora, v_head], and the two projections that read the
        hidden state (q_a_proj, kv_a_proj_with_mqa) as one call."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head, self.lora)
        self.w_uk = w[:, :self.nope].contiguous()
        self.w_uv = w[:, self.nope:].transpose(1, 2).contiguous()
        if hasattr(self, "q_a_proj"):
            self.qkv_a_proj = fuse_linears([self.q_a_proj, self.kv_a_proj_with_mqa])
            if self.qkv_a_proj is not None:
                del self.q_a_proj, self.kv_a_proj_with_mqa

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(queries [T, heads * (qk_nope + rope)], kv_a output [T, lora + rope], the query latent after
        q_a_layernorm [T, q_lora_rank] or None without a query rank)."""
        if hasattr(self, "q_proj"):
            return self.q_proj(x), self.kv_a_proj_with_mqa(x), None
        if self.qkv_a_proj is not None:
            q_a, kv = self.qkv_a_proj(x).split([self.qkv_a_proj.out_features - self.lora - self.rope,
                                                self.lora + self.rope], dim=-1)
        else:
            q_a, kv = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        q_latent = self.q_a_layernorm(q_a)
        return self.q_b_proj(q_latent), kv, q_latent

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        T, H = x.shape[0], self.num_heads
        q, kv, q_latent = self._project(x)
        q = q.view(T, H, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        c = self.kv_a_layernorm(kv[:, :self.lora])
        k_pe = kv[:, None, self.lora:]
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, cos, sin), apply_rotary(k_pe, cos, sin)
        cache = meta.kv_caches[self.layer_idx]
        index = None
        if self.indexer is not None:  # the index key is stored after k_pe
            iq, iw, ik = self.indexer(x, q_latent, cos, sin)
            index = (iq, iw, self.indexer.topk)
            k_pe = torch.cat([k_pe, ik[:, None]], dim=-1)
        cache.write(meta.full.slot_mapping, k_pe, c[:, None])
        w_uk, w_uv = self.w_uk, self.w_uv
        if w_uk is None:
            w = self.kv_b_proj.weight.view(H, self.nope + self.v_head, self.lora)
            w_uk, w_uv = w[:, :self.nope], w[:, self.nope:].transpose(1, 2)
        q_lat = head_products(q_nope, w_uk)  # [T, H, lora]: W_UK^T q_nope
        o = latent_attention(torch.cat([q_lat, q_pe], dim=-1), cache, meta.full, self.scale, index)
        o = head_products(o, w_uv)  # [T, H, v_head]: W_UV o
        return self.o_proj(o.reshape(T, H * self.v_head))
