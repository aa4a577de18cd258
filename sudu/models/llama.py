"""Llama-family decoder (llama; qwen2 reuses it with q/k/v bias). Network only: weights arrive by name
(Hugging Face names) through load_state_dict; KV storage and sampling live elsewhere."""
from __future__ import annotations

import torch
from torch import nn

from sudu import kernels
from sudu.layers import linear
from sudu.layers.attention import NATIVE_MAX_Q, AttentionMetadata, QKVProjections, paged_attention
from sudu.layers.kv_cache import NATIVE_POOL_DTYPES, Int8KVCache, KVCache
from sudu.layers.mlp import GatedMLP
from sudu.layers.moe import SparseMoE
from sudu.layers.norm import RMSNorm
from sudu.layers.rotary import rotate_heads_, scaled_rotary
from sudu.model_config import ModelConfig

_NO_SCALE = torch.empty(0)  # a float32 pool's place in the native stack's scale lists, an absent bias's in its weights


def native_step(x: torch.Tensor, views: list, caches: list[KVCache]) -> bool:
    """Whether a step can take a one-call native decode stack (kernels/decoder.cpp): float32 rows, fewer than a
    prompt's, every sequence of every view few-new-token (attended by the native kernel), and pools it reads."""
    return (x.dtype == torch.float32 and x.shape[0] < linear.PREFILL_MIN_ROWS
            and all(v.decode is not None and not v.seqs and v.decode.rows.shape[1] <= NATIVE_MAX_Q for v in views)
            and all(type(c) is Int8KVCache or (type(c) is KVCache and c.k.dtype in NATIVE_POOL_DTYPES) for c in caches))


def native_pools(caches: list[KVCache]) -> tuple[list, list, list, list, list, bool]:
    """The native stack's pool lists: K pools, V pools, K scales, V scales, K centres (empty tensors for float
    pools), and whether their attention takes the bfloat16 tiles (one arithmetic for the whole model:
    KVCache.bf16_tiles)."""
    return ([c.k for c in caches], [c.v for c in caches],
            [c.k_scale if type(c) is Int8KVCache else _NO_SCALE for c in caches],
            [c.v_scale if type(c) is Int8KVCache else _NO_SCALE for c in caches],
            [c.k_centre if type(c) is Int8KVCache else _NO_SCALE for c in caches], caches[0].bf16_tiles)


def native_linear(p) -> list[torch.Tensor] | None:
    """A projection as the native stack takes it, [tiles, bias or an empty tensor], or None where it cannot: a
    layer that is not quantized, or whose outputs are not whole tiles (QuantizedLinear.fits_native_stack)."""
    if not (isinstance(p, linear.QuantizedLinear) and p.fits_native_stack()):
        return None
    return [p.qweight, p.bias if p.bias is not None else _NO_SCALE]


def decode_view(view) -> list[torch.Tensor]:
    """A view's decode batch as the native stack takes it: slot_mapping, rows, slots, mask."""
    d = view.decode
    return [view.slot_mapping, d.rows, d.slots, d.mask[:, 0]]


def vars_of(params) -> tuple:
    return (params.top_k, params.norm_topk, params.scaling, params.sigmoid, params.shared)


def moe_params(ext, moe: SparseMoE):
    """The native stack's routing parameters for this expert layer, or None where its router uses what
    kernels/moe.cpp does not do (expert groups, a correction bias)."""
    params = moe.gate.native_params(ext)
    if params is not None:
        params.shared = 1 if moe.shared_expert is not None else 2 if moe.shared_experts is not None else 0
    return params


class LlamaAttention(QKVProjections, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        T, H, Hk = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = rotate_heads_(self.project_qkv(x).view(T, H + 2 * Hk, self.head_dim), H + Hk, cos, sin)  # q and k heads
        o = paged_attention(qkv[:, :H], qkv[:, H:H + Hk], qkv[:, H + Hk:], self.layer_idx, meta, self.scale, sliding=False)
        return self.o_proj(o.reshape(T, -1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward blocks; `attention` and `mlp` are the variants' own modules (q/k
    norms, routed experts, latent attention), built from (cfg, layer_idx)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention=LlamaAttention, mlp=None):
        super().__init__()
        self.self_attn = attention(cfg, layer_idx)
        self.mlp = mlp(cfg, layer_idx) if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                                                        cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta):
        """x: the previous layer's output (the embeddings at layer 0, with residual None); residual: the
        residual stream before it. Returns (this layer's output, the residual stream before it): each residual
        add is done in one pass with the norm that follows it (RMSNorm.add_forward)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(residual, x)
        residual, h = self.post_attention_layernorm.add_forward(residual, self.self_attn(h, cos, sin, meta))
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attention=LlamaAttention, mlp=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, attention, mlp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The llama decoder stack. Variants pass their attention module class and an mlp factory (cfg,
    layer_idx) -> module; the one-call native decode stack applies only to the plain llama layers."""
    PLAIN_HEAD = True  # compute_logits is lm_head(hidden) and nothing else (layers/bounded_head.py)

    def __init__(self, cfg: ModelConfig, attention=LlamaAttention, mlp=None):
        super().__init__()
        self.config = cfg
        self.layer_kinds = (attention, mlp)  # what a multi-token-prediction layer of this model is built from
        self.model = LlamaModel(cfg, attention, mlp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = scaled_rotary(cfg)
        self._native_decode = None  # (kernels llama_decode, its weight list): set by prepare_native_decode

    def prepare_native_decode(self) -> None:
        """After quantization and fusion (engine/network.py prepare_network): collect the weights of
        kernels/decoder.cpp's one-call decode stack, which steps of few-new-token sequences then take. It
        applies to quantized fused projections (group 32), SiLU MLPs and float32 norms; otherwise every step
        stays on the layers below."""
        self._native_decode = None
        ext = kernels.load()
        if ext is None or not self.model.norm.weight.is_cpu or self.model.norm.weight.dtype != torch.float32:
            return
        def native_mlp(mlp) -> list[torch.Tensor] | None:
            if type(mlp) is not GatedMLP or mlp._silu_mul is None:
                return None
            gate_up, down = native_linear(mlp.gate_up_proj), native_linear(mlp.down_proj)
            return None if gate_up is None or down is None else [*gate_up, *down]

        weights, experts, moe = [], [], None
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o = native_linear(getattr(attn, "qkv_proj", None)), native_linear(attn.o_proj)
            if type(attn) is not LlamaAttention or attn.head_dim % 8 or qkv is None or o is None:
                return
            # the order decoder.cpp reads: norm, qkv, o, norm, then the feed-forward's tensors
            weights += [layer.input_layernorm.weight, *qkv, *o, layer.post_attention_layernorm.weight]
            if isinstance(mlp, SparseMoE):
                params = moe_params(ext, mlp)
                parts = [native_mlp(e) for e in mlp.experts]
                shared = mlp.shared_expert if mlp.shared_expert is not None else mlp.shared_experts
                shared_part = native_mlp(shared) if shared is not None else []
                if params is None or (moe is not None and vars_of(moe) != vars_of(params)) or None in parts or shared_part is None:
                    return
                moe = params
                gate = [mlp.shared_expert_gate.weight] if mlp.shared_expert is not None else []
                weights += [mlp.gate.weight, *(t for part in parts for t in part), *gate, *shared_part]
                experts.append(len(parts))
            else:
                part = native_mlp(mlp)
                if part is None:
                    return
                weights += part
                experts.append(0)
        self._native_decode = (ext.llama_decode, weights, experts, moe or ext.MoeParams())

    def _decode_natively(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor | None:
        """The one-call native stack for a step of few-new-token sequences over the KV pools the attention kernel
        reads (layers/kv_cache.py NATIVE_POOL_DTYPES), or None."""
        native = self._native_decode
        if native is None or meta.sliding is not None or not native_step(x, [meta.full], meta.kv_caches):
            return None
        fn, weights, experts, moe = native
        attn = self.model.layers[0].self_attn
        return fn(x, weights, *native_pools(meta.kv_caches), *decode_view(meta.full), cos, sin, attn.num_heads,
                  attn.num_kv_heads, attn.head_dim, self.model.norm.eps, attn.scale, self.model.norm.weight, experts, moe)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] (all sequences' new tokens, flat). Returns final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions, x.dtype)
        return self.decode_layers(x, cos, sin, meta)

    def decode_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
                      ) -> torch.Tensor:
        """The decoder stack over input embeddings x [T, hidden] with their rotary cos/sin [T, head_dim]: the final
        hidden states (what forward returns after embedding; vision-language networks enter here too)."""
        out = self._decode_natively(x, cos, sin, meta)
        if out is not None:
            return out
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        return self.model.norm.add_forward(residual, x)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
