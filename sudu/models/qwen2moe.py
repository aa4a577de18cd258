"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v bias) with routed experts and a
shared expert scaled by its own sigmoid gate. Network only."""
from __future__ import annotations

import dataclasses

from sudu.layers.moe import moe_or_dense_mlp
from sudu.model_config import ModelConfig
from sudu.models.llama import LlamaForCausalLM


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(dataclasses.replace(cfg, attention_bias=True), mlp=moe_or_dense_mlp)
