"""Verification of draft tokens against the target model's logits, lossless by construction.

Greedy accepts a draft token while it equals the target's argmax, then appends the target's own token, so
the output is identical to plain greedy decoding. With temperature it is exact rejection sampling: accept d
with probability min(1, p(d)/q(d)), otherwise draw from the normalised max(0, p - q); after all drafts pass,
draw a bonus token from p. (An n-gram draft is a point mass, q = one-hot.) p is the distribution plain
sampling would use: penalties, temperature, top-k, top-p and min-p applied, so the sampled output keeps
exactly that distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sudu.layers.sampler import (
    SamplingRow,
    apply_penalties,
    argmax_rows,
    filter_logits,
)


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len, vocab] draft distribution; None -> point masses (n-gram)

    def head(self, k: int) -> Draft:
        """The first k tokens."""
        return Draft(self.token_ids[:k], self.probs[:k] if self.probs is not None else None)


def _needs_penalties(row: SamplingRow) -> bool:
    p = row.params
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def target_distribution(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The distribution plain sampling draws from for this row (temperature > 0)."""
    if _needs_penalties(row):
        logits = apply_penalties(logits.clone(), row)
    return filter_logits(logits, row.params).softmax(-1)


def verify_draft(logits: torch.Tensor, draft: Draft, row: SamplingRow, generator: torch.Generator) -> list[int]:
    """logits: [len(draft) + 1, vocab] target logits at the last token and at each draft token.
    Returns the accepted draft prefix followed by one token chosen by the target."""
    m = len(draft.token_ids)
    history = list(row.output_token_ids)
    out: list[int] = []
    for i in range(m + 1):
        cur = SamplingRow(row.params, row.prompt_token_ids, history, None)
        if row.params.greedy:
            lg = apply_penalties(logits[i].clone(), cur) if _needs_penalties(cur) else logits[i]
            token = int(argmax_rows(lg[None])[0])
            out.append(token)
            if i < m and token == draft.token_ids[i]:
                history.append(token)
                continue
            return out
        p = target_distribution(logits[i], cur)
        if i == m:
            out.append(int(torch.multinomial(p, 1, generator=generator)))
            return out
        d = draft.token_ids[i]
        if draft.probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft.probs[i]
        accept_prob = min(1.0, float(p[d]) / max(float(q[d]), 1e-30))
        if float(torch.rand((), generator=generator)) < accept_prob:
            out.append(d)
            history.append(d)
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    return out
