"""Qwen3 (dense): the llama decoder with an RMSNorm over each query and key head before RoPE and no q/k/v
bias. Network only."""
from __future__ import annotations

import torch

from sudu.layers.attention import AttentionMetadata, paged_attention
from sudu.layers.norm import RMSNorm
from sudu.layers.rotary import rotate_heads_
from sudu.model_config import ModelConfig
from sudu.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        T, H, Hk, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.project_qkv(x).view(T, H + 2 * Hk, D)
        q = self.q_norm(qkv[:, :H].reshape(T * H, D)).view(T, H, D)
        k = self.k_norm(qkv[:, H:H + Hk].reshape(T * Hk, D)).view(T, Hk, D)
        qk = rotate_heads_(torch.cat([q, k], dim=1), H + Hk, cos, sin)
        o = paged_attention(qk[:, :H], qk[:, H:], qkv[:, H + Hk:], self.layer_idx, meta, self.scale, sliding=False)
        return self.o_proj(o.reshape(T, -1))


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, attention=Qwen3Attention)
