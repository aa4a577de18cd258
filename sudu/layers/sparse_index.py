"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2): which past tokens each query attends to.

Per token the indexer has queries q^I (index_n_heads heads of index_head_dim, from the query latent) with
per-head weights w^I (from the hidden state), and one key k^I (index_head_dim, LayerNorm'd); the first
qk_rope_head_dim channels of both carry RoPE in the rotate-half layout. Token t's score of a visible token
s is I(t, s) = sum_j w^I(t, j) * ReLU(q^I(t, j) . k^I(s) / sqrt(index_head_dim)) / sqrt(index_n_heads), and
t attends to the index_topk best only (all of them while fewer are visible).

The index key lives in the layer's pool next to the rotary key part (the pool's K is [k_pe ; k^I]), so
block tables, prefix caching, preemption and int8 KV hold it as they hold the rest. Selection is made
deterministic: scores in float64, ties broken towards the earlier token (a stable sort), so a row's
choice does not depend on how many other rows or keys came with it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from sudu.layers.rotary import apply_rotary

if TYPE_CHECKING:
    from sudu.model_config import ModelConfig


class LightningIndexer(nn.Module):
    """Hugging Face names under self_attn.indexer: wq_b, wk, k_norm (LayerNorm with bias), weights_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope = cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: hidden states [T, hidden]; q_latent: the query latent after q_a_layernorm [T, q_lora_rank].
        Returns (queries [T, heads, head_dim] pre-scaled by 1/sqrt(head_dim), head weights [T, heads] pre-scaled
        by 1/sqrt(heads), key [T, head_dim]), RoPE applied."""
        T = x.shape[0]
        q = self.wq_b(q_latent).view(T, self.heads, self.head_dim)
        k = self.k_norm(self.wk(x))[:, None]
        r = self.rope
        q = torch.cat([apply_rotary(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([apply_rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1)[:, 0]
        w = self.weights_proj(x) * self.heads ** -0.5
        return q * self.head_dim ** -0.5, w, k


SCORE_BLOCK_ELEMENTS = 1 << 24  # float64 index scores held at once: query rows are scored in blocks below this
ROW_BLOCK = 16  # query rows attended together over their gathered keys


def top_k_keys(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, topk: int):
    """Each query row's chosen keys, best first: (indices [..., R, topk] into the keys, valid [..., R, topk]).

    q [..., R, heads, head_dim] and w [..., R, heads] (LightningIndexer's, pre-scaled), keys [..., K, head_dim]
    (index keys from the pool), visible [..., R, K] bool. Always `topk` columns: a row that sees fewer keys
    has its invisible ones last, marked invalid. Rows are scored in blocks (a row's scores alone decide its
    choice), so a long prompt never holds every score at once."""
    num_keys = keys.shape[-2]
    rows = q.shape[-3]
    width = min(topk, num_keys)
    order = torch.empty(*visible.shape[:-1], width, dtype=torch.long, device=q.device)
    per_row = max(1, q[..., :1, :, :].numel() // q.shape[-1] * num_keys)
    block = max(1, SCORE_BLOCK_ELEMENTS // per_row)
    keys64 = keys.double()
    for start in range(0, rows, block):
        sl = slice(start, start + block)
        scores = torch.einsum("...rhd,...kd->...rhk", q[..., sl, :, :].double(), keys64).relu_()
        index = torch.einsum("...rh,...rhk->...rk", w[..., sl, :].double(), scores)
        index.masked_fill_(~visible[..., sl, :], float("-inf"))
        order[..., sl, :] = torch.sort(index, dim=-1, descending=True, stable=True).indices[..., :width]
    valid = visible.gather(-1, order)
    if width < topk:  # pad to topk columns, invalid
        pad = topk - width
        order = torch.cat([order, order.new_zeros(*order.shape[:-1], pad)], dim=-1)
        valid = torch.cat([valid, valid.new_zeros(*valid.shape[:-1], pad)], dim=-1)
    return order, valid


def attend_selected(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float, value_dim: int) -> torch.Tensor:
    """Latent attention of query rows over their own gathered keys: q [R, H, D], keys [R, topk, D] (the
    values are their first value_dim columns), valid [R, topk]. Returns [R, H, value_dim]. Every row has
    the same topk columns whatever the batch, and invalid ones hold zeros and weigh exactly 0, so a row's
    numbers do not depend on what else is attended with it."""
    keys = keys.masked_fill(~valid[..., None], 0.0)
    out = q.new_empty(q.shape[0], q.shape[1], value_dim)
    for start in range(0, q.shape[0], ROW_BLOCK):
        sl = slice(start, start + ROW_BLOCK)
        scores = torch.bmm(q[sl], keys[sl].transpose(1, 2)) * scale  # [r, H, topk]
        scores.masked_fill_(~valid[sl, None, :], float("-inf"))
        out[sl] = torch.bmm(scores.softmax(dim=-1), keys[sl, :, :value_dim])
    return out
