"""Qwen2 / Qwen2.5: the llama decoder with bias on the q/k/v projections (always on in this family)."""
from __future__ import annotations

import dataclasses

from sudu.model_config import ModelConfig
from sudu.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(dataclasses.replace(cfg, attention_bias=True))
