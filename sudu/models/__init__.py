"""Model registry: architecture name -> network class, imported only when that architecture is built (a
server for one model does not import the other networks). Each class takes a ModelConfig, accepts Hugging
Face tensor names through load_state_dict, and exposes forward(input_ids, positions, meta) and
compute_logits(hidden)."""
from __future__ import annotations

import importlib

from torch import nn

from sudu.model_config import ModelConfig

# architecture -> (module under sudu.models, class name)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "gemma3": ("gemma3", "Gemma3ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "deepseek2": ("deepseek2", "DeepseekV2ForCausalLM"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "gemma3_vl": ("gemma3_vl", "Gemma3ForConditionalGeneration"),
}


def model_class(architecture: str) -> type[nn.Module]:
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"sudu.models.{module}"), name)


def build_model(cfg: ModelConfig) -> nn.Module:
    return model_class(cfg.architecture)(cfg)
