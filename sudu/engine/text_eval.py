"""A text's logits through a network in one pass: what perplexity and greedy-agreement measurements use (the
quantization accuracy tests, benchmarks/native_quality.py) and what the int8 KV calibration runs
(engine/model_runner.py), and the hidden states the bounded head's directions come from."""
from __future__ import annotations

import math

import torch

from sudu.layers import linear
from sudu.layers.attention import build_metadata
from sudu.layers.kv_cache import KVCache


@torch.inference_mode()
def forward_text(model: torch.nn.Module, token_ids: list[int], pools: list) -> torch.Tensor:
    """Final hidden states [n, hidden] of one sequence of token_ids, computed in one pass over the given
    per-layer KV pools (slots 0..n-1), sliding-window layers under their window mask."""
    cfg = model.config
    n = len(token_ids)
    window = cfg.sliding_window if "sliding_attention" in cfg.layer_types else None
    device = pools[0].k.device
    sdpa_dtype = linear.prefill_attention_dtype(model) if n >= linear.PREFILL_MIN_ROWS and device.type == "cpu" else None
    meta = build_metadata([n], [torch.arange(n)], pools, window, sdpa_dtype=sdpa_dtype)
    if device.type != "cpu":
        meta = meta.to(device)
    return model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), meta)


def float_pools(cfg, n: int) -> list:
    """Temporary float32 KV pools of n slots per layer, for one pass over a text."""
    heads, k_dim, v_dim = cfg.kv_cache_shape()
    return [KVCache(n, heads, k_dim, torch.float32, v_head_dim=v_dim) for _ in range(cfg.num_hidden_layers)]


@torch.inference_mode()
def final_hidden(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """The final hidden states [n, hidden] of one pass over token_ids (on the CPU, temporary float32 pools)."""
    return forward_text(model, token_ids, float_pools(model.config, len(token_ids)))


@torch.inference_mode()
def text_logits(model: torch.nn.Module, token_ids: list[int], pools: list | None = None,
                prefill_min_rows: int = 1 << 30) -> torch.Tensor:
    """float32 logits at every position, over the given per-layer KV pools (default: temporary float32
    ones). linear.PREFILL_MIN_ROWS is set to prefill_min_rows for the call: by default every row goes
    through the decode kernel, as decoding computes it. (tests/test_quantization_accuracy.py measures
    through this too.)"""
    if pools is None:
        pools = float_pools(model.config, len(token_ids))
    with linear.prefill_path_as(prefill_min_rows):
        return model.compute_logits(forward_text(model, token_ids, pools)).float()


@torch.inference_mode()
def next_token_scores(model: torch.nn.Module, token_ids: list[int], pools: list, rows: int = 64
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each next token [n-1], greedy token at each position [n-1]) of one pass over
    token_ids with the given pools; logits `rows` positions at a time (a vocabulary-wide row is large)."""
    hidden = forward_text(model, token_ids, pools)[:-1]
    target = torch.tensor(token_ids[1:])
    logp, top = [], []
    for i in range(0, hidden.shape[0], rows):
        logits = model.compute_logits(hidden[i:i + rows]).float()
        logp.append(torch.log_softmax(logits, dim=-1).gather(1, target[i:i + rows, None])[:, 0])
        top.append(logits.argmax(-1))
    return torch.cat(logp), torch.cat(top)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """Perplexity of token_ids[1:] under logits[:-1] (logits at every position of token_ids)."""
    target = torch.tensor(token_ids[1:]).unsqueeze(1)
    return math.exp(-torch.log_softmax(logits[:-1], dim=-1).gather(1, target).mean().item())
