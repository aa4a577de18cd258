"""Mixture-of-experts feed-forward: a router picks k experts per token, and the chosen experts' gated MLPs
run on the tokens that chose them.

Expert execution: the batch's (token, expert) pairs are sorted by expert, so each selected expert is
called once per step on all its tokens (its weights are read once, whatever the batch) and an expert no
token chose is never touched. The loop runs over the selected experts, never over tokens. Each expert is
an ordinary GatedMLP, so `quantize_model` turns its projections into int8/int4 QuantizedLinear layers and
`fuse_projections` fuses its gate/up pair like a dense model's; a token's output sums its experts in
expert order, so a row's numbers do not depend on what else is in the batch.

Routing (the variants in use):
  softmax   softmax over all experts, top-k, optionally renormalised (Qwen-MoE, Mixtral, DeepSeek-V2);
  sigmoid   DeepSeek-V3: sigmoid scores; a per-expert correction bias shifts the scores used to choose
            (never the weights); experts are split into n_group groups, each scored by the sum of its two
            best, and only the topk_group best groups are eligible.
DeepSeek-V2's group-limited greedy scores a group by its best expert. Weights are then scaled by
routed_scaling_factor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from sudu import kernels
from sudu.layers.linear import FloatWeight
from sudu.layers.mlp import GatedMLP

if TYPE_CHECKING:  # sudu.models imports the model files, which import this module
    from sudu.model_config import ModelConfig


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T computed row by row (one batched vector-matrix product per token), so a row's numbers
    never depend on how many rows come with it; F.linear picks different GEMM kernels by batch size, and a
    router weight that moves in the last bit can change a close routing decision."""
    return torch.bmm(x[:, None, :], weight.t().expand(x.shape[0], *weight.t().shape))[:, 0]


class Router(nn.Module):
    """Expert choice per token. The weight stays a float parameter (not an nn.Linear), so quantization
    leaves it alone: routing decides which weights are read at all (llama.cpp keeps it in float too)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scoring_func = cfg.scoring_func
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.router_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        else:
            self.e_score_correction_bias = None
        self._native = None  # (kernels' moe_route, its MoeParams) where it applies: see native_params

    def native_params(self, ext):
        """kernels' MoeParams for this router (shared expert unset), or None where it uses what moe_route
        does not do (expert groups, a correction bias)."""
        if ext is None or self.n_group > 1 or self.e_score_correction_bias is not None \
                or self.scoring_func not in ("softmax", "sigmoid"):
            return None
        params = ext.MoeParams()
        params.top_k, params.norm_topk = self.top_k, bool(self.norm_topk_prob)
        params.scaling, params.sigmoid = float(self.routed_scaling_factor), self.scoring_func == "sigmoid"
        return params

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights float32 [T, k], expert ids [T, k]). On CPU with the native kernels the
        choice is kernels' moe_route (what the native decode stack computes, so both choose alike)."""
        if self._native is None:
            ext = kernels.load()
            params = self.native_params(ext)
            self._native = (ext.moe_route, params) if params is not None else False
        if self._native and x.is_cpu and self.weight.is_cpu:
            route, params = self._native
            return route(x.float().contiguous(), self.weight.float().contiguous(), params)
        logits = rowwise_linear(x.float(), self.weight.float())
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            if self.scoring_func == "sigmoid":
                group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = groups.amax(dim=-1)
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).view(-1, self.num_experts)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights, ids


def run_experts(experts: nn.ModuleList, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every token t, one call per selected expert."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=len(experts))
    tokens = order // k
    pair_weights = weights.reshape(-1)[order].to(x.dtype)[:, None]
    out = torch.zeros_like(x)
    selected = counts.nonzero().flatten().tolist()
    ends = counts.cumsum(0).tolist()
    for e in selected:
        start, end = ends[e] - int(counts[e]), ends[e]
        rows = tokens[start:end]
        out.index_add_(0, rows, experts[e](x.index_select(0, rows)) * pair_weights[start:end])
    return out


class SparseMoE(nn.Module):
    """Routed experts, plus the always-on shared expert of Qwen2-MoE (`shared_expert`, scaled by
    sigmoid(x @ shared_expert_gate)) or DeepSeek (`shared_experts`, unscaled). Parameter names are the
    Hugging Face checkpoints' (mlp.gate, mlp.experts.{e}.{gate,up,down}_proj, ...)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = self.shared_experts = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
            if cfg.shared_expert_gate:
                self.shared_expert = shared
                self.shared_expert_gate = FloatWeight(1, cfg.hidden_size)
            else:
                self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = run_experts(self.experts, x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(rowwise_linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def moe_or_dense_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """The feed-forward block of layer layer_idx: routed experts where the config says so, else the dense
    gated MLP (DeepSeek's first layers, Qwen-MoE's mlp_only_layers)."""
    if cfg.is_moe(layer_idx):
        return SparseMoE(cfg)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
