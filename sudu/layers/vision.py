"""Vision towers' attention: bidirectional attention within segments of a packed sequence of patches (one image,
or one window of an image), every patch attending to every patch of its segment and to nothing else. Segments
of equal length run as one batched call, so an image cut into many equal windows costs a few calls, not one per
window. And the towers' stages: a tower's forward written as a generator that pauses after each block's
attention and after its MLP (`EncodeStages`), so that an engine can spread one image's encoding over several
steps (engine/image_encoding.py); `run_stages` runs them back to back, which is what a plain call does."""
from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                      scale: float) -> torch.Tensor:
    """q, k, v: [N, heads, head_dim]; bounds: segment boundaries 0 = b0 < b1 < ... < bn = N. Returns [N, heads,
    head_dim], each row attending only within its segment."""
    out = torch.empty_like(q)
    by_len: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            by_len.setdefault(b - a, []).append(a)
    for length, starts in by_len.items():
        rows = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).reshape(-1)
        n = len(starts)

        def heads_first(x: torch.Tensor) -> torch.Tensor:  # [n, heads, length, head_dim]
            return x[rows].view(n, length, *x.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), scale=scale)
        out[rows] = o.transpose(1, 2).reshape(n * length, *q.shape[1:])
    return out


# a tower's encoding, paused after each stage (a block's attention, its MLP): next() runs the next one; the
# embeddings are its return value
EncodeStages = Generator[None, None, torch.Tensor]


def run_stages(stages: EncodeStages) -> torch.Tensor:
    """Every stage at once: the embeddings, exactly as a spread-out encoding computes them."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value
