"""Statistics for sudu bench: per-figure summaries (n, mean, median, p90, p99) with a seeded bootstrap
95% CI of the mean, and the bootstrap CI of an A/B ratio of means. Too few samples -> no CI, said so.

The bootstrap resamples what is independent, never less:
- `iid`: one value per request (TTFT, TPOT, E2E, ...);
- `cluster`: values that come in groups sharing a cause, such as the ITL gaps of one request (one slow
  request makes all its gaps slow): whole requests are resampled, the statistic is the pooled mean;
- `block`: a time series, such as tokens per second: contiguous blocks of it are resampled (circular
  moving blocks of about sqrt(n)), which keeps the dependence between neighbouring seconds.
Resampling dependent values as if independent makes intervals too narrow.

A handful of repetitions (sweep's points: each one a long request) is too few for the bootstrap; there
`t_interval` gives Student's t interval of the mean, which assumes the values roughly normal and is exact
for them at any n >= 2."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from scipy.special import stdtrit

MIN_SAMPLES_FOR_CI = 10  # resampling units (values, requests, blocks' worth of seconds) below which no CI
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
    resampling: str = "iid"
    n_units: int = 0  # independent units resampled: values, requests (cluster) or seconds (block)

    def to_dict(self) -> dict:
        return asdict(self)


def _prepare(data, kind: str):
    """-> (pooled values, the resampling units, number of units)."""
    if kind == "cluster":
        groups = [np.asarray([v for v in g if v is not None], dtype=float) for g in data]
        groups = [g for g in groups if g.size]
        pooled = np.concatenate(groups) if groups else np.zeros(0)
        return pooled, groups, len(groups)
    if kind not in ("iid", "block"):
        raise ValueError(f"unknown resampling {kind!r}")
    values = np.asarray([v for v in data if v is not None], dtype=float)
    return values, values, int(values.size)


def block_length(n: int) -> int:
    return max(1, int(round(np.sqrt(n))))


def resampled_means(units, kind: str, rng: np.random.Generator, resamples: int = BOOTSTRAP_RESAMPLES) -> np.ndarray:
    """`resamples` bootstrap replicates of the mean, resampling by `kind` (see the module docstring)."""
    if kind == "cluster":
        sums = np.asarray([g.sum() for g in units])
        counts = np.asarray([g.size for g in units], dtype=float)
        idx = rng.integers(0, len(units), size=(resamples, len(units)))
        return sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    n = units.size
    if kind == "block":
        length = block_length(n)
        k = -(-n // length)
        starts = rng.integers(0, n, size=(resamples, k, 1))
        idx = ((starts + np.arange(length)) % n).reshape(resamples, k * length)[:, :n]
        return units[idx].mean(axis=1)
    return units[rng.integers(0, n, size=(resamples, n))].mean(axis=1)


def summarize(values, seed: int = DEFAULT_SEED, min_n: int = MIN_SAMPLES_FOR_CI, kind: str = "iid") -> Summary:
    """`values`: numbers (iid, block: in time order) or, for kind="cluster", a list of groups of numbers."""
    data, units, n_units = _prepare(values, kind)
    n = int(data.size)
    if n == 0:
        return Summary(n=0, note="no samples", resampling=kind)
    median, p90, p99 = (float(x) for x in np.percentile(data, [50, 90, 99]))
    s = Summary(n=n, mean=float(data.mean()), median=median, p90=p90, p99=p99, resampling=kind, n_units=n_units)
    if n_units < min_n:
        s.note = f"{TOO_FEW} for a 95% CI ({n_units} {_unit(kind)} < {min_n})"
        return s
    s.ci_low, s.ci_high = bootstrap_mean_ci(units, seed, kind=kind)
    return s


def _unit(kind: str) -> str:
    return {"cluster": "requests", "block": "seconds"}.get(kind, "samples")


def bootstrap_mean_ci(units, seed: int = DEFAULT_SEED, level: float = 0.95, kind: str = "iid") -> tuple[float, float]:
    if kind != "cluster":
        units = np.asarray(units, dtype=float)
    means = resampled_means(units, kind, np.random.default_rng(seed))
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


def ratio_ci(a, b, seed: int = DEFAULT_SEED, min_n: int = MIN_SAMPLES_FOR_CI, level: float = 0.95,
             kind: str = "iid") -> Ratio:
    """mean(B) / mean(A); A and B resampled independently of each other, each by `kind`."""
    xa, units_a, na = _prepare(a, kind)
    xb, units_b, nb = _prepare(b, kind)
    r = Ratio(ratio=None, n_a=int(xa.size), n_b=int(xb.size))
    if xa.size == 0 or xb.size == 0:
        r.note = "no samples"
        return r
    mean_a = xa.mean()
    if mean_a == 0:
        r.note = "baseline mean is 0"
        return r
    r.ratio = float(xb.mean() / mean_a)
    if min(na, nb) < min_n:
        r.note = f"{TOO_FEW} for a 95% CI ({min(na, nb)} {_unit(kind)} < {min_n})"
        return r
    rng = np.random.default_rng(seed)
    ma = resampled_means(units_a, kind, rng)
    mb = resampled_means(units_b, kind, rng)
    ok = ma != 0
    ratios = mb[ok] / ma[ok]
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(ratios, [alpha, 1.0 - alpha])
    r.ci_low, r.ci_high = float(low), float(high)
    r.significant = not (r.ci_low <= 1.0 <= r.ci_high)
    if not r.significant:
        r.note = "not significant (CI contains 1)"
    return r


def t_interval(values, level: float = 0.95) -> tuple[float | None, float | None]:
    """Student's t interval of the mean: mean +- t(level, n-1) * s / sqrt(n), s the sample standard
    deviation (n - 1 in the denominator). (None, None) below two values."""
    x = np.asarray([v for v in values if v is not None], dtype=float)
    if x.size < 2:
        return None, None
    half = float(stdtrit(x.size - 1, 0.5 + level / 2.0)) * float(x.std(ddof=1)) / np.sqrt(x.size)
    return float(x.mean()) - half, float(x.mean()) + half
