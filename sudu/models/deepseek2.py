"""DeepSeek-V2 / V3: the llama decoder skeleton with multi-head latent attention (layers/mla.py: latent KV in
the pool, absorbed attention, YaRN) and routed experts with shared experts after the first dense layers
(layers/moe.py: V2 softmax / group-limited greedy, V3 sigmoid with correction bias and group-limited
top-k). Network only; the MTP layers a V3 checkpoint may carry are not part of this network."""
from __future__ import annotations

from sudu.layers.mla import LatentAttention
from sudu.layers.moe import moe_or_dense_mlp
from sudu.model_config import ModelConfig
from sudu.models.llama import LlamaForCausalLM


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, attention=LatentAttention, mlp=moe_or_dense_mlp)
