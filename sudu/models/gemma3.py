"""Gemma 3 text decoder: interleaved sliding-window (local) and global attention layers, q/k RMSNorm,
sandwich norms around attention and MLP, embeddings scaled by sqrt(hidden_size), separate RoPE bases
for local and global layers. Network only."""
from __future__ import annotations

import torch
from torch import nn

from sudu.layers.attention import AttentionMetadata, QKVProjections, paged_attention
from sudu.layers.mlp import GatedMLP
from sudu.layers.norm import RMSNorm
from sudu.layers.rotary import RotaryEmbedding, apply_rotary
from sudu.models.config import ModelConfig


class Gemma3Attention(QKVProjections, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding = cfg.is_sliding(layer_idx)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        T, H, Hk = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.project_qkv(x).view(T, H + 2 * Hk, self.head_dim)
        q, k, v = self.q_norm(qkv[:, :H]), self.k_norm(qkv[:, H:H + Hk]), qkv[:, H + Hk:]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = paged_attention(q, k, v, self.layer_idx, meta, self.scale, sliding=self.sliding)
        return self.o_proj(o.reshape(T, -1))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.sliding = cfg.is_sliding(layer_idx)
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)

    def forward(self, x, rope_global, rope_local, meta):
        cos, sin = rope_local if self.sliding else rope_global
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Gemma3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        n = cfg.max_position_embeddings
        self.rotary_global = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, n, cfg.rope_scaling_factor)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.rope_local_base_freq or 10000.0, n)
        self.embed_scale = cfg.hidden_size ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # the reference rounds the scale to the embedding dtype before multiplying
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope_global = self.rotary_global.lookup(positions, x.dtype)
        rope_local = self.rotary_local.lookup(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, rope_global, rope_local, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
