"""Mixtral: the llama decoder with routed experts in every layer (8 experts, top-2, renormalised). Its
checkpoints name the experts block_sparse_moe.experts.{e}.w1/w3/w2; the loader reads them under the
Qwen-MoE names this network uses (weights/safetensors.py canonical_name). Network only."""
from __future__ import annotations

from sudu.layers.moe import moe_or_dense_mlp
from sudu.model_config import ModelConfig
from sudu.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, mlp=moe_or_dense_mlp)
