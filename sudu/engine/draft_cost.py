"""Which draft tokens pay for their verification rows: a cost-aware draft length for free drafters
(n-gram lookup), per sequence and per step.

A draft token costs nothing to propose but a row to verify. At one stream that row is almost free (the
step reads the weights once whatever its rows); at 8 streams or more the step is partly compute-bound and
each row adds to everyone's step time. A token is worth its row when the tokens it is expected to add
per second of step time beat what the step already produces per second:

    alpha_s ** i / row_s  >=  (1 + REJECTED_ROW_COST * (1 - alpha_s)) * tokens per step / step seconds

where alpha_s is sequence s's per-token acceptance (a draft's i-th token survives only if the i-1 before
it did) and row_s is the measured cost of one more row in a decode step. Positions are taken greedily
from the most likely across the batch, and the step's rate is updated as they are added, so a batch of
sequences that accept well drafts long and one that does not drafts nothing (it decodes as plain).

Both estimates are measured online: row_s by an exponentially weighted least-squares fit of decode
steps' wall time against their rows (the slope near the current operating point), alpha_s from each
sequence's verifications (accepted tokens over accepted tokens plus rejections: the maximum-likelihood
per-token acceptance of a draft cut at its first rejection), pulled toward the engine-wide rate while
the sequence has few verifications of its own.
"""
from __future__ import annotations


class StepCost:
    """Decode-step seconds ~ a + b * rows, fit over recent decode steps (weights decay by `retention` per
    step, so the fit follows the batch as it changes)."""

    MIN_STEPS = 6  # steps before the fit is used

    def __init__(self, retention: float = 0.95):
        self.retention = retention
        self.sums = [0.0] * 5  # weighted: n, sum x, sum x^2, sum y, sum x*y
        self.steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        x, y = float(rows), seconds
        self.sums = [r * self.retention + v for r, v in zip(self.sums, (1.0, x, x * x, y, x * y))]
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b) seconds, or None while the steps seen are too few or their rows too alike to tell a
        row's cost apart from the step's."""
        n, sx, sxx, sy, sxy = self.sums
        if self.steps < self.MIN_STEPS:
            return None
        var = n * sxx - sx * sx
        if var < 0.5 * n * n:  # rows' weighted spread under ~0.7: the slope is not determined
            return None
        b = max((n * sxy - sx * sy) / var, 0.0)
        a = max((sy - b * sx) / n, 1e-6)
        return a, b


class Acceptance:
    """Per-sequence per-token acceptance, from its verifications, with the engine-wide rate as prior."""

    PRIOR = 2.0  # events (accepted tokens plus rejections) of the engine-wide rate in a sequence's estimate
    RETENTION = 0.9  # per verification: recent drafts count more (a sequence moves from copying to writing)

    def __init__(self):
        self.accepted = 0.0  # engine-wide, all verifications
        self.rejected = 0.0
        self.seqs: dict[int, list[float]] = {}  # seq_id -> [accepted tokens, rejections], decayed

    def update(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        rejected = 1.0 if num_accepted < num_drafted else 0.0
        self.accepted += num_accepted
        self.rejected += rejected
        a, r = self.seqs.get(seq_id, (0.0, 0.0))
        self.seqs[seq_id] = [a * self.RETENTION + num_accepted, r * self.RETENTION + rejected]

    def rate(self, seq_id: int) -> float:
        prior = (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)
        a, r = self.seqs.get(seq_id, (0.0, 0.0))
        return (a + self.PRIOR * prior) / (a + r + self.PRIOR)

    def release(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)


# What a rejected draft row costs beyond the fit's price of a row, in units of that price. The linear fit
# prices a row, not what comes with a row that does not become a token (the sampler's work on it, the
# rollback of its KV slot and of the sequence's draft state), nor the per-step work an accepted row saves.
# At 4 streams, free text with 40-50% acceptance, which the fit priced a few percent ahead, ran 5-8% behind
# plain decoding; a factor of 2 on every row fixed that but also cut copying drafts (95%+ accepted) at 4
# streams from 1.67x to 1.24x (docs/benchmarks.md, "n-gram on by default"). So the factor a token must clear
# is 1 + REJECTED_ROW_COST * (1 - alpha): 2 at 50% acceptance, near 1 for copying.
REJECTED_ROW_COST = 2.0


def keep_lengths(proposed: list[int], alphas: list[float], step: tuple[float, float] | None,
                 num_rows: int, num_tokens: int, rejected_row_cost: float = REJECTED_ROW_COST) -> list[int]:
    """How many of each sequence's proposed draft tokens to verify. proposed[i]: tokens on offer for
    sequence i, alphas[i]: its acceptance; step: the fit (a, b) or None (not measured yet: keep them
    all); num_rows / num_tokens: the step's rows and the tokens it yields without drafts;
    rejected_row_cost: see REJECTED_ROW_COST."""
    if step is None:
        return list(proposed)
    a, b = step
    seconds = a + b * num_rows
    tokens = float(num_tokens)
    keep = [0] * len(proposed)
    # the i-th token of every sequence, the best value (expected gain over the factor it must clear) first:
    # alpha ** i falls with i, so each sequence's tokens come in order, and the step's tokens per second
    # only rise as tokens that clear the bar are added, so the first one that does not ends the search
    offers = sorted(((alpha ** i / (1.0 + rejected_row_cost * (1.0 - alpha)), s)
                     for s, (n, alpha) in enumerate(zip(proposed, alphas)) for i in range(1, n + 1)),
                    key=lambda o: -o[0])
    for value, s in offers:
        if value * seconds < b * tokens:
            break
        keep[s] += 1
        tokens += alphas[s] ** keep[s]
        seconds += b
    return keep
