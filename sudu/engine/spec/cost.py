"""Which draft tokens pay for their verification rows: a cost-aware draft length for free drafters
(n-gram lookup), per sequence and per step.

A draft token costs nothing to propose but a row to verify. At one stream that row is almost free (the
step reads the weights once whatever its rows); at 8 streams or more the step is partly compute-bound and
each row adds to everyone's step time. A token is worth its row when the tokens it is expected to add
per second of step time beat what the step already produces per second:

    alpha_s ** i / row_s  >=  PAYBACK * tokens per step / step seconds

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


# A draft token is verified only when its expected gain is this many times its row's measured cost. The
# linear fit prices a row, not what comes with verifying at all (a sequence's verification bookkeeping, its
# k + 1 logit rows through the sampler), so drafts the fit prices barely ahead lose to plain decoding;
# drafts that copy text (mostly accepted) clear the factor. Flat, not scaled by the expected rejections:
# the alternatives and their runs are in docs/benchmarks.md, "n-gram on by default".
PAYBACK = 2.0


def keep_lengths(proposed: list[int], alphas: list[float], step: tuple[float, float] | None,
                 num_rows: int, num_tokens: int, payback: float = PAYBACK) -> list[int]:
    """How many of each sequence's proposed draft tokens to verify. proposed[i]: tokens on offer for
    sequence i, alphas[i]: its acceptance; step: the fit (a, b) or None (not measured yet: keep them
    all); num_rows / num_tokens: the step's rows and the tokens it yields without drafts; payback: the
    expected gain a token must bring per unit of its cost."""
    if step is None:
        return list(proposed)
    a, b = step
    seconds = a + b * num_rows
    tokens = float(num_tokens)
    keep = [0] * len(proposed)
    # the i-th token of every sequence, most likely first (alpha ** i falls with i, so each sequence's
    # tokens come in order)
    offers = sorted(((alpha ** i, s) for s, (n, alpha) in enumerate(zip(proposed, alphas))
                     for i in range(1, n + 1)), key=lambda o: -o[0])
    for gain, s in offers:
        if gain * seconds < payback * b * tokens:
            break
        keep[s] += 1
        tokens += gain
        seconds += b
    return keep
