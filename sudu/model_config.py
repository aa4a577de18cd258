"""ModelConfig: the shape of a network, independent of where its weights come from.

Field names follow Hugging Face's config.json so a safetensors directory maps 1:1;
the GGUF loader (weights/gguf.py) fills the same fields from GGUF metadata.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("qwen2", "llama", "gemma3", "qwen3", "qwen2moe", "qwen3moe", "mixtral", "deepseek2",
                           "qwen2_5_vl", "gemma3_vl")
# config.json model_type -> architecture
MODEL_TYPES = {"qwen2": "qwen2", "llama": "llama", "gemma3_text": "gemma3", "gemma3": "gemma3", "qwen3": "qwen3",
               "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "mixtral", "deepseek_v2": "deepseek2",
               "deepseek_v3": "deepseek2", "deepseek_v32": "deepseek2", "qwen2_5_vl": "qwen2_5_vl",
               "qwen2_5_vl_text": "qwen2_5_vl"}


# transformers' Gemma3TextConfig and SiglipVisionConfig defaults, which Gemma 3's config.json leaves out
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0, "bos_token_id": 2,
}
SIGLIP_VISION_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
}


@dataclass
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2 always has q/k/v bias
    hidden_act: str = "silu"
    # gemma3: local (sliding-window) layers use rope_local_base_freq, global layers rope_theta
    rope_local_base_freq: float | None = None
    rope_scaling_factor: float | None = None  # linear scaling of global layers (gemma3 1B+)
    sliding_window: int | None = None
    # per layer: "sliding_attention" or "full_attention"; None -> all full
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float | None = None  # gemma3: scale = query_pre_attn_scalar ** -0.5
    # mixture of experts (qwen2moe, qwen3moe, mixtral, deepseek2); num_experts 0 = dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    moe_layers: list[bool] | None = None  # per layer: routed experts (True) or the dense MLP; None -> all
    norm_topk_prob: bool = False  # renormalise the selected experts' weights to sum to 1
    scoring_func: str = "softmax"  # router scores: "softmax" or "sigmoid" (DeepSeek-V3)
    router_correction_bias: bool = False  # V3: a per-expert bias added to the scores for selection only
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # group-limited top-k: experts in n_group groups, only topk_group groups eligible
    topk_group: int = 1
    shared_expert_intermediate_size: int = 0  # an always-on expert next to the routed ones; 0 = none
    shared_expert_gate: bool = False  # qwen2moe: the shared expert's output scaled by sigmoid(x @ w)
    # multi-head latent attention (deepseek2)
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # deepseek2: rotary over (even, odd) channel pairs
    # YaRN scaling (Hugging Face's rope_type "yarn" parameters: factor, original_max_position_embeddings,
    # beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor)
    rope_yarn: dict | None = None
    # Llama 3.1's scaling (rope_type "llama3": factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings)
    rope_llama3: dict | None = None
    # DeepSeek Sparse Attention (DeepSeek-V3.2, layers/sparse_index.py): a lightning indexer of index_n_heads
    # heads of index_head_dim ranks the past tokens; each query attends to its index_topk best. 0 = dense
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    num_nextn_predict_layers: int = 0  # DeepSeek-V3 MTP layers stored after the decoder layers
    # multimodal rotary (Qwen2-VL family): the rotary channel pairs given to the temporal, height and width
    # position, in that order (sums to head_dim / 2); None: one position per token
    mrope_section: list[int] | None = None
    # a vision-language model: its vision tower's config.json section and the prompt's image placeholder id
    vision_config: dict | None = None
    image_token_id: int | None = None
    mm_tokens_per_image: int | None = None  # Gemma 3: the embeddings (and placeholder tokens) of one image
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; sudu runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must name one attention type per layer")
        if self.num_experts and self.moe_layers is None:
            self.moe_layers = [True] * self.num_hidden_layers
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(heads, K width, V width) of one token's entry in one layer's pool. Multi-head latent attention
        keeps one shared entry: the rotary key part as K and the compressed latent as V; with sparse attention
        the indexer's key follows the rotary part in K."""
        if self.kv_lora_rank:
            return 1, self.qk_rope_head_dim + (self.index_head_dim if self.index_topk else 0), self.kv_lora_rank
        return self.num_key_value_heads, self.head_dim, self.head_dim

    def kv_rotary_spans(self) -> list[tuple[int, int]]:
        """(start, width) spans of a pool entry's K that RoPE rotates in halves: all of K, or with latent
        attention its rotary part, and the sparse-attention index key's first qk_rope_head_dim channels."""
        if not self.kv_lora_rank:
            return [(0, self.head_dim)]
        rope = self.qk_rope_head_dim
        return [(0, rope), (rope, rope)] if self.index_topk else [(0, rope)]

    def is_moe(self, layer_idx: int) -> bool:
        return bool(self.num_experts) and self.moe_layers[layer_idx]

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "sliding_attention"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (text config for multimodal wrappers)."""
        outer = cfg
        cfg = dict(cfg.get("text_config", cfg)) if "text_config" in cfg else dict(cfg)
        model_type = cfg.get("model_type", "")
        arch = MODEL_TYPES.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json")
        if arch == "gemma3" and outer.get("model_type") == "gemma3" and "vision_config" in outer:
            arch = "gemma3_vl"  # Gemma3ForConditionalGeneration: the text decoder plus its SigLIP tower
            # the released files write only what differs from transformers' defaults
            cfg = {**GEMMA3_TEXT_DEFAULTS, **cfg}
            if cfg.get("eos_token_id") is None:
                cfg["eos_token_id"] = outer.get("eos_token_id")
            outer = {**outer, "vision_config": {**SIGLIP_VISION_DEFAULTS, **outer["vision_config"]}}
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in cfg.items() if k in names and v is not None}
        kwargs["architecture"] = arch
        if arch in ("qwen2", "qwen2moe", "qwen2_5_vl"):
            kwargs["attention_bias"] = True
        if arch in ("qwen2_5_vl", "gemma3_vl"):
            _vision_fields(outer, cfg, kwargs)
        if arch in ("qwen2", "qwen2moe", "qwen2_5_vl", "qwen3", "qwen3moe", "mixtral", "deepseek2", "llama"):
            # qwen ships sliding_window with use_sliding_window=false; the others attend globally
            kwargs.pop("sliding_window", None)
            kwargs.pop("layer_types", None)
        _moe_fields(arch, cfg, kwargs)
        # rope: transformers >= 5 writes rope_parameters (per layer type for gemma3), older configs
        # rope_theta / rope_local_base_freq / rope_scaling
        rope = cfg.get("rope_parameters") or {}
        rope_global = rope.get("full_attention", rope)
        rope_local = rope.get("sliding_attention", {})
        scaling = cfg.get("rope_scaling") or rope_global
        if "rope_theta" in rope_global:
            kwargs["rope_theta"] = float(rope_global["rope_theta"])
        if "rope_theta" in rope_local:
            kwargs["rope_local_base_freq"] = float(rope_local["rope_theta"])
        kwargs.update(rope_scaling_fields(scaling, cfg.get("max_position_embeddings")))
        if kwargs.get("rope_yarn"):  # YaRN's context: the original one times the factor (Qwen2.5's model cards)
            yarn = kwargs["rope_yarn"]
            kwargs["max_position_embeddings"] = max(cfg.get("max_position_embeddings") or 0,
                                                    int(yarn["original_max_position_embeddings"] * yarn["factor"]))
        if arch in ("gemma3", "gemma3_vl"):
            kwargs.setdefault("tie_word_embeddings", True)
            kwargs.setdefault("rope_local_base_freq", 10000.0)
            kwargs["hidden_act"] = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
            if kwargs.get("layer_types") is None:
                pattern = cfg.get("sliding_window_pattern", 6)
                kwargs["layer_types"] = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                    for i in range(cfg["num_hidden_layers"])
                ]
        eos = cfg.get("eos_token_id")
        kwargs["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(**kwargs)


def _vision_fields(outer: dict, text: dict, kwargs: dict) -> None:
    """A vision-language checkpoint's vision tower, image placeholder and multimodal rotary (Qwen2.5-VL) or image
    token count (Gemma 3): config.json keeps
    them next to the text config (transformers >= 5 nests that in text_config; older files inline it)."""
    if not isinstance(outer.get("vision_config"), dict):
        raise ValueError("a vision-language config.json needs its vision_config")
    kwargs["vision_config"] = dict(outer["vision_config"])
    kwargs["image_token_id"] = outer.get("image_token_id", outer.get("image_token_index", text.get("image_token_id")))
    if kwargs["architecture"] == "gemma3_vl":
        kwargs["mm_tokens_per_image"] = int(outer.get("mm_tokens_per_image", 256))
    else:
        rope = text.get("rope_parameters") or text.get("rope_scaling") or outer.get("rope_scaling") or {}
        kwargs["mrope_section"] = list(rope.get("mrope_section", [16, 24, 24]))
    if "tie_word_embeddings" in outer:
        kwargs["tie_word_embeddings"] = bool(outer["tie_word_embeddings"])


ROPE_SCALINGS = ("linear", "yarn", "llama3")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate")


def rope_scaling_fields(scaling: dict, max_position_embeddings: int | None = None) -> dict:
    """ModelConfig's RoPE fields for a Hugging Face rope_scaling (or rope_parameters) dict: linear ->
    rope_scaling_factor, yarn -> rope_yarn, llama3 -> rope_llama3; none or "default" -> {}. Raises
    ValueError for a scaling sudu does not apply, rather than run the model with the wrong positions."""
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind == "default":
        return {}
    if kind not in ROPE_SCALINGS:
        why = (": its frequencies change with the sequence's current length, so a cached token's K would depend on "
               "how long its sequence later grows" if kind == "dynamic" else "")
        raise ValueError(f"RoPE scaling {kind!r} is not supported{why}; sudu applies {', '.join(ROPE_SCALINGS)}")
    factor = scaling.get("factor")
    original = scaling.get("original_max_position_embeddings")
    if factor is None and kind == "yarn" and original and max_position_embeddings:
        factor = max_position_embeddings / original  # transformers' rule when only the two lengths are given
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ValueError(f"RoPE scaling {kind!r} needs a factor > 0, got {factor!r}")
    if kind == "linear":
        return {"rope_scaling_factor": float(factor)}
    if not isinstance(original, int) or original < 1:
        raise ValueError(f"RoPE scaling {kind!r} needs original_max_position_embeddings (the context the model "
                         f"was trained at), got {original!r}")
    if kind == "yarn":
        fields = {k: scaling[k] for k in _YARN_KEYS if scaling.get(k) is not None}
        return {"rope_yarn": {**fields, "factor": float(factor)}}
    return {"rope_llama3": {"factor": float(factor), "original_max_position_embeddings": original,
                            "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
                            "high_freq_factor": float(scaling.get("high_freq_factor", 4.0))}}


def with_rope_scaling(cfg: ModelConfig, scaling: dict) -> ModelConfig:
    """cfg with its RoPE scaling replaced by `scaling` (`--rope-scaling`, Hugging Face's rope_scaling
    form), and its context extended to original_max_position_embeddings (default: the model's own) times
    the factor. {"type": "default"} removes a scaling."""
    fields = rope_scaling_fields(scaling, cfg.max_position_embeddings)
    out = dataclasses.replace(cfg, **{"rope_scaling_factor": None, "rope_yarn": None, "rope_llama3": None, **fields})
    factor = scaling.get("factor") or 1.0
    original = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
    out.max_position_embeddings = max(cfg.max_position_embeddings, int(original * factor)) if fields else original
    return out


def _moe_fields(arch: str, cfg: dict, kwargs: dict) -> None:
    """The routed-expert fields each family spells its own way in config.json."""
    n = cfg["num_hidden_layers"]
    # Qwen checkpoints say num_experts, Mixtral and transformers >= 5 num_local_experts, DeepSeek n_routed_experts
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if experts:
        kwargs["num_experts"] = experts
    if arch in ("qwen2moe", "qwen3moe"):
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        kwargs["moe_layers"] = [i not in dense and (i + 1) % step == 0 for i in range(n)]
        kwargs["norm_topk_prob"] = bool(cfg.get("norm_topk_prob", arch == "qwen3moe"))
        if arch == "qwen2moe":
            kwargs["shared_expert_intermediate_size"] = cfg.get("shared_expert_intermediate_size", 0)
            kwargs["shared_expert_gate"] = True
    elif arch == "mixtral":
        kwargs["norm_topk_prob"] = True
    elif arch == "deepseek2":
        first_dense = cfg.get("first_k_dense_replace", 0)
        step = cfg.get("moe_layer_freq", 1)
        kwargs["moe_layers"] = [i >= first_dense and i % step == 0 for i in range(n)]
        kwargs["shared_expert_intermediate_size"] = (cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"]
        v3 = cfg.get("model_type") in ("deepseek_v3", "deepseek_v32")
        kwargs["scoring_func"] = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
        kwargs["router_correction_bias"] = v3 or cfg.get("topk_method") == "noaux_tc"
        kwargs["norm_topk_prob"] = bool(cfg.get("norm_topk_prob", False))
        kwargs["n_group"] = cfg.get("n_group") or 1
        kwargs["topk_group"] = cfg.get("topk_group") or 1
        if not v3 and cfg.get("topk_method", "greedy") == "greedy":  # V2-Lite: plain top-k over all experts
            kwargs["n_group"] = kwargs["topk_group"] = 1
        kwargs["head_dim"] = cfg["qk_rope_head_dim"]
