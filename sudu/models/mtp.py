"""DeepSeek-V3's multi-token-prediction (MTP) layer, as a network that drafts for speculative decoding.

Position i of the layer reads the target's final hidden state h_i and the embedding of the token after it,
t_{i+1}, and predicts t_{i+2}:

    x_i = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])      -> one decoder layer (its own attention KV)
    logits_i = shared_head.head(shared_head.norm(x_i'))

Names are the checkpoint's, inside model.layers.{num_hidden_layers} (GGUF: blk.N.nextn.*). The embedding
and the head are the target's when the checkpoint leaves them out. h_i is what the target's forward
returns (after its final norm), as vLLM and SGLang feed it; a chained draft (more than one per step) reads
the layer's own output in place of the target hidden state it does not have yet.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from sudu.errors import SuduError
from sudu.layers.attention import AttentionMetadata
from sudu.layers.norm import RMSNorm
from sudu.model_config import ModelConfig
from sudu.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


def with_mtp_layer(cfg: ModelConfig) -> ModelConfig:
    """cfg with one more layer, of the kind of its last one (DeepSeek's MTP layer is routed like it)."""
    n = cfg.num_hidden_layers
    return dataclasses.replace(cfg, num_hidden_layers=n + 1, layer_types=cfg.layer_types + cfg.layer_types[-1:],
                               moe_layers=cfg.moe_layers + cfg.moe_layers[-1:] if cfg.moe_layers is not None else None)


class MTPLayer(LlamaDecoderLayer):
    """The target's decoder layer kind at index num_hidden_layers (so DeepSeek's is MoE), plus the input
    projection and the shared head. Its attention reads KV cache 0 of the drafter's own pool."""

    def __init__(self, cfg: ModelConfig, attention, mlp):
        super().__init__(with_mtp_layer(cfg), cfg.num_hidden_layers, attention, mlp)
        self.self_attn.layer_idx = 0
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)


class MultiTokenPredictor(nn.Module):
    """The network the drafter's ModelRunner runs: forward(ids, positions, meta, hidden_in) -> the layer's
    output [T, hidden] (before the shared head's norm); compute_logits maps rows of it to logits."""

    def __init__(self, cfg: ModelConfig, target: LlamaForCausalLM):
        super().__init__()
        self.config = cfg
        attention, mlp = target.layer_kinds
        self.layer = MTPLayer(cfg, attention, mlp)
        self.rotary = target.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden_in: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        e = layer.enorm(layer.embed_tokens(input_ids))
        # as vLLM's MTP: position 0 has no token before it in training, so its embedding is zeroed
        e = e.masked_fill((positions == 0)[:, None], 0.0)
        x = layer.eh_proj(torch.cat([e, layer.hnorm(hidden_in.to(e.dtype))], dim=-1))
        cos, sin = self.rotary.lookup(positions, x.dtype)
        out, residual = layer(x, None, cos, sin, meta)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.layer.shared_head
        return head.head(head.norm(hidden))


def load_mtp_network(ckpt, target: LlamaForCausalLM, dtype: torch.dtype) -> MultiTokenPredictor:
    """The checkpoint's first MTP layer as a network, with the target's embedding and head where the
    checkpoint stores none. A SuduError names what is missing."""
    cfg = ckpt.config
    state = ckpt.mtp_tensors(dtype)
    if not state:
        raise SuduError(f"--speculative mtp needs a checkpoint with multi-token-prediction layers; {ckpt.path.name} "
                        "has none (DeepSeek-V3 stores them as model.layers.{num_hidden_layers}, GGUF: "
                        "nextn_predict_layers)")
    if not hasattr(target, "layer_kinds"):
        raise SuduError(f"--speculative mtp is not supported for the {cfg.architecture} architecture")
    with torch.device("meta"):
        net = MultiTokenPredictor(cfg, target)
    missing, unexpected = net.layer.load_state_dict(state, strict=False, assign=True)
    # the embedding and the head are the target's when the checkpoint does not repeat them (the modules
    # themselves: the target's head may be quantized)
    shared = {"embed_tokens.weight": ("embed_tokens", target.model.embed_tokens),
              "shared_head.head.weight": ("shared_head.head", target.lm_head)}
    for name in [m for m in missing if m in shared]:
        path, module = shared[name]
        parent, _, child = path.rpartition(".")
        setattr(net.layer.get_submodule(parent) if parent else net.layer, child, module)
        missing.remove(name)
    if missing or unexpected:
        raise SuduError(f"the MTP layer of {ckpt.path.name} does not match the {cfg.architecture} network: "
                        f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}")
    return net.eval()
