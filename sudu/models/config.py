"""ModelConfig: the shape of a network, independent of where its weights come from.

Field names follow Hugging Face's config.json so a safetensors directory maps 1:1;
the GGUF loader (weights/gguf.py) fills the same fields from GGUF metadata.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("qwen2", "llama", "gemma3")


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

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "sliding_attention"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (text config for multimodal wrappers)."""
        cfg = dict(cfg.get("text_config", cfg)) if "text_config" in cfg else dict(cfg)
        model_type = cfg.get("model_type", "")
        arch = {"qwen2": "qwen2", "llama": "llama", "gemma3_text": "gemma3", "gemma3": "gemma3"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in cfg.items() if k in names and v is not None}
        kwargs["architecture"] = arch
        if arch == "qwen2":
            kwargs["attention_bias"] = True
            kwargs.pop("sliding_window", None)  # qwen2 ships it with use_sliding_window=false
            kwargs.pop("layer_types", None)
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
        if scaling.get("rope_type", scaling.get("type")) == "linear":
            kwargs["rope_scaling_factor"] = float(scaling["factor"])
        if arch == "gemma3":
            kwargs.setdefault("tie_word_embeddings", True)
            kwargs.setdefault("rope_local_base_freq", 10000.0)
            kwargs["hidden_act"] = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
            if kwargs.get("layer_types") is None:
                pattern = cfg.get("sliding_window_pattern", 6)
                kwargs["layer_types"] = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                    for i in range(cfg["num_hidden_layers"])
                ]
        elif arch == "llama":
            kwargs.pop("layer_types", None)
            kwargs.pop("sliding_window", None)
        eos = cfg.get("eos_token_id")
        kwargs["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(**kwargs)
