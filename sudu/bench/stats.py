"""Statistics for sudu bench: per-figure summaries (n, mean, median, p90, p99) with a seeded bootstrap
95% CI of the mean, and the bootstrap CI of an A/B ratio of means. Too few samples -> no CI, said so."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

MIN_SAMPLES_FOR_CI = 10  # below this a percentile bootstrap of the mean is not worth printing
BOOTSTRAP_RESAMPLES = 2000
DEFAULT_SEED = 0
TOO_FEW = "too few samples"


@dataclass
class Summary:
    n: int
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    ci_low: float | None = None  # bootstrap 95% CI of the mean
    ci_high: float | None = None
    note: str = ""  # "too few samples" when there is no CI

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(values, seed: int = DEFAULT_SEED, min_n: int = MIN_SAMPLES_FOR_CI) -> Summary:
    data = np.asarray([v for v in values if v is not None], dtype=float)
    n = int(data.size)
    if n == 0:
        return Summary(n=0, note="no samples")
    median, p90, p99 = (float(x) for x in np.percentile(data, [50, 90, 99]))
    s = Summary(n=n, mean=float(data.mean()), median=median, p90=p90, p99=p99)
    if n < min_n:
        s.note = f"{TOO_FEW} for a 95% CI (n={n} < {min_n})"
        return s
    s.ci_low, s.ci_high = bootstrap_mean_ci(data, seed)
    return s


def bootstrap_mean_ci(data, seed: int = DEFAULT_SEED, level: float = 0.95) -> tuple[float, float]:
    data = np.asarray(data, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, data.size, size=(BOOTSTRAP_RESAMPLES, data.size))
    means = data[idx].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


@dataclass
class Ratio:
    """mean(B) / mean(A) with a bootstrap CI; significant when the CI excludes 1."""

    ratio: float | None
    ci_low: float | None = None
    ci_high: float | None = None
    significant: bool | None = None
    n_a: int = 0
    n_b: int = 0
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def ratio_ci(a, b, seed: int = DEFAULT_SEED, min_n: int = MIN_SAMPLES_FOR_CI, level: float = 0.95) -> Ratio:
    xa = np.asarray([v for v in a if v is not None], dtype=float)
    xb = np.asarray([v for v in b if v is not None], dtype=float)
    r = Ratio(ratio=None, n_a=int(xa.size), n_b=int(xb.size))
    if xa.size == 0 or xb.size == 0:
        r.note = "no samples"
        return r
    mean_a = xa.mean()
    if mean_a == 0:
        r.note = "baseline mean is 0"
        return r
    r.ratio = float(xb.mean() / mean_a)
    if min(xa.size, xb.size) < min_n:
        r.note = f"{TOO_FEW} for a 95% CI (n={min(xa.size, xb.size)} < {min_n})"
        return r
    rng = np.random.default_rng(seed)
    ma = xa[rng.integers(0, xa.size, size=(BOOTSTRAP_RESAMPLES, xa.size))].mean(axis=1)
    mb = xb[rng.integers(0, xb.size, size=(BOOTSTRAP_RESAMPLES, xb.size))].mean(axis=1)
    ok = ma != 0
    ratios = mb[ok] / ma[ok]
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(ratios, [alpha, 1.0 - alpha])
    r.ci_low, r.ci_high = float(low), float(high)
    r.significant = not (r.ci_low <= 1.0 <= r.ci_high)
    if not r.significant:
        r.note = "not significant (CI contains 1)"
    return r
