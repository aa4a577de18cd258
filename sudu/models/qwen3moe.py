"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k head norms, no bias) with routed experts
(softmax top-k, renormalised), no shared expert. Network only."""
from __future__ import annotations

from sudu.layers.moe import moe_or_dense_mlp
from sudu.model_config import ModelConfig
from sudu.models.llama import LlamaForCausalLM
from sudu.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, attention=Qwen3Attention, mlp=moe_or_dense_mlp)
