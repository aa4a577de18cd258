"""Model registry: architecture name -> network class. Each class takes a ModelConfig, accepts Hugging
Face tensor names through load_state_dict, and exposes forward(input_ids, positions, meta) and
compute_logits(hidden)."""
from __future__ import annotations

from torch import nn

from sudu.models.config import ModelConfig
from sudu.models.deepseek2 import DeepseekV2ForCausalLM
from sudu.models.gemma3 import Gemma3ForCausalLM
from sudu.models.llama import LlamaForCausalLM
from sudu.models.mixtral import MixtralForCausalLM
from sudu.models.qwen2 import Qwen2ForCausalLM
from sudu.models.qwen2moe import Qwen2MoeForCausalLM
from sudu.models.qwen3 import Qwen3ForCausalLM
from sudu.models.qwen3moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen2moe": Qwen2MoeForCausalLM,
    "qwen3moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "deepseek2": DeepseekV2ForCausalLM,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    return ARCHITECTURES[cfg.architecture](cfg)
