"""The gated feed-forward block of llama-family and gemma networks: down(act(gate(x)) * up(x))."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from sudu.layers.linear import fuse_linears

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {hidden_act!r}")
        self.act = ACTIVATIONS[hidden_act]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj with one gate_up_proj (after the weights are loaded and quantized)."""
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
