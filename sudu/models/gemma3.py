"""Gemma 3 text decoder: interleaved sliding-window (local) and global attention layers, q/k RMSNorm,
sandwich norms around attention and MLP, embeddings scaled by sqrt(hidden_size), separate RoPE bases
for local and global layers. Network only; decode steps of few-new-token sequences take the one-call native
stack (kernels/decoder.cpp gemma_decode), which chains the same functions as the layers below."""
from __future__ import annotations

import torch
from torch import nn

from sudu import kernels
from sudu.layers.attention import AttentionMetadata, QKVProjections, paged_attention
from sudu.layers.mlp import GatedMLP
from sudu.layers.norm import RMSNorm
from sudu.layers.rotary import RotaryEmbedding, rotate_heads_, scaled_rotary
from sudu.model_config import ModelConfig
from sudu.models.llama import decode_view, native_linear, native_pools, native_step


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
        qk = rotate_heads_(torch.cat([self.q_norm(qkv[:, :H]), self.k_norm(qkv[:, H:H + Hk])], dim=1), H + Hk, cos, sin)
        o = paged_attention(qk[:, :H], qk[:, H:], qkv[:, H + Hk:], self.layer_idx, meta, self.scale, sliding=self.sliding)
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

    def forward(self, delta, residual, rope_global, rope_local, meta):
        """(delta, residual): the previous layer's output before its residual add (residual None: delta is the
        embeddings). Returns this layer's (delta, residual)."""
        cos, sin = rope_local if self.sliding else rope_global
        if residual is None:
            residual, x = delta, self.input_layernorm(delta)
        else:
            residual, x = self.input_layernorm.add_forward(residual, delta)
        attn = self.post_attention_layernorm(self.self_attn(x, cos, sin, meta))
        residual, x = self.pre_feedforward_layernorm.add_forward(residual, attn)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)


class Gemma3ForCausalLM(nn.Module):
    PLAIN_HEAD = True  # compute_logits is lm_head(hidden) and nothing else (layers/bounded_head.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Gemma3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        n = cfg.max_position_embeddings
        self.rotary_global = scaled_rotary(cfg)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.rope_local_base_freq or 10000.0, n)
        self.embed_scale = cfg.hidden_size ** 0.5
        # (kernels gemma_decode, its weight list, sliding flags, final norm weight): prepare_native_decode
        self._native_decode = None

    def prepare_native_decode(self) -> None:
        """After quantization and fusion (engine/network.py prepare_network): collect the weights of
        kernels/decoder.cpp's gemma_decode, which steps of few-new-token sequences then take. It applies to
        quantized fused projections whose outputs are whole tiles, the tanh-GELU MLP and float32 norms;
        otherwise every step stays on the layers below."""
        self._native_decode = None
        ext = kernels.load()
        norm = self.model.norm
        if (ext is None or not norm.weight.is_cpu or norm.weight.dtype != torch.float32
                or self.config.hidden_act != "gelu_pytorch_tanh"):
            return

        weights, sliding = [], []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [native_linear(getattr(attn, "qkv_proj", None)), native_linear(attn.o_proj),
                     native_linear(mlp.gate_up_proj), native_linear(mlp.down_proj)]
            if None in parts or attn.head_dim % 8:
                return
            qkv, o, gate_up, down = parts
            # the order decoder.cpp reads; each norm's weight as its kernel multiplies by (1 + w)
            weights += [layer.input_layernorm._native_weight(), *qkv, attn.q_norm._native_weight(),
                        attn.k_norm._native_weight(), *o, layer.post_attention_layernorm._native_weight(),
                        layer.pre_feedforward_layernorm._native_weight(), *gate_up, *down,
                        layer.post_feedforward_layernorm._native_weight()]
            sliding.append(int(layer.sliding))
        self._native_decode = (ext.gemma_decode, weights, sliding, norm._native_weight())

    def _decode_natively(self, x, rope_global, rope_local, meta: AttentionMetadata) -> torch.Tensor | None:
        native = self._native_decode
        local = meta.sliding if meta.sliding is not None else meta.full
        if native is None or not native_step(x, [meta.full, local], meta.kv_caches):
            return None
        fn, weights, sliding, final_norm = native
        attn = self.model.layers[0].self_attn
        return fn(x, weights, *native_pools(meta.kv_caches), sliding, decode_view(meta.full), decode_view(local),
                  *rope_global, *rope_local, attn.num_heads, attn.num_kv_heads, attn.head_dim, self.model.norm.eps,
                  attn.scale, final_norm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # the reference rounds the scale to the embedding dtype before multiplying
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return self.decode_layers(x, positions, meta)

    def decode_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      native: bool = True) -> torch.Tensor:
        """The decoder over input embeddings x [T, hidden]; native: steps of few-new-token sequences may take
        the one-call stack."""
        rope_global = self.rotary_global.lookup(positions, x.dtype)
        rope_local = self.rotary_local.lookup(positions, x.dtype)
        out = self._decode_natively(x, rope_global, rope_local, meta) if native else None
        if out is not None:
            return out
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope_global, rope_local, meta)
        return self.model.norm.add_forward(residual, x)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
