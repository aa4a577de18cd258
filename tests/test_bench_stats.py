"""Bootstrap statistics: CIs cover the true mean, too few samples are said so, A/B ratios and their
significance verdicts; arrival processes and SLO parsing."""
import numpy as np
import pytest

from sudu.bench.metrics import parse_slo, token_gap
from sudu.bench.stats import MIN_SAMPLES_FOR_CI, TOO_FEW, ratio_ci, summarize
from sudu.bench.workloads import arrival_offsets, make_messages
from sudu.errors import SuduError


def test_ci_covers_true_mean_on_normal_data():
    rng = np.random.default_rng(123)
    trials, covered = 100, 0
    for i in range(trials):
        s = summarize(rng.normal(10.0, 2.0, size=50), seed=i)
        assert s.ci_low < s.mean < s.ci_high
        covered += s.ci_low <= 10.0 <= s.ci_high
    assert covered >= 88  # nominal 95%; the percentile bootstrap runs a little narrow at n=50


def test_summary_fields_and_seeded():
    data = list(range(1, 101))
    s = summarize(data)
    assert (s.n, s.mean, s.median) == (100, 50.5, 50.5)
    assert s.p90 == pytest.approx(np.percentile(data, 90)) and s.p99 == pytest.approx(np.percentile(data, 99))
    assert summarize(data).to_dict() == s.to_dict()  # same seed, same CI


def test_too_few_samples():
    s = summarize([1.0, 2.0, 3.0])
    assert s.n == 3 and s.mean == 2.0 and s.ci_low is None and TOO_FEW in s.note
    assert summarize([]).n == 0
    assert summarize([None, 1.0] * MIN_SAMPLES_FOR_CI).n == MIN_SAMPLES_FOR_CI
    r = ratio_ci([1.0, 2.0], [2.0, 4.0])
    assert r.ratio == 2.0 and r.significant is None and TOO_FEW in r.note


def test_ratio_significance():
    rng = np.random.default_rng(0)
    a = rng.normal(100, 5, 200)
    r = ratio_ci(a, a * 0.5)
    assert r.ratio == pytest.approx(0.5) and r.significant and r.ci_low < 0.5 < r.ci_high
    same = ratio_ci(rng.normal(100, 5, 200), rng.normal(100, 5, 200))
    assert same.significant is False and same.ci_low <= 1.0 <= same.ci_high and "not significant" in same.note


def test_arrival_processes():
    n, rate = 4000, 20.0
    for arrival in ("poisson", "gamma", "constant"):
        t = arrival_offsets(n, rate, arrival, burstiness=0.5, seed=1)
        assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
        assert (n - 1) / t[-1] == pytest.approx(rate, rel=0.08)
    gaps_poisson = np.diff(arrival_offsets(n, rate, "poisson", seed=1))
    gaps_bursty = np.diff(arrival_offsets(n, rate, "gamma", burstiness=0.25, seed=1))
    assert np.std(gaps_bursty) > 1.5 * np.std(gaps_poisson)  # gamma shape < 1 is burstier
    assert np.ptp(np.diff(arrival_offsets(10, rate, "constant"))) < 1e-12
    assert arrival_offsets(3, None) == [0.0, 0.0, 0.0]
    with pytest.raises(SuduError):
        arrival_offsets(3, 1.0, "weibull")


def test_cache_state_prompts():
    a = make_messages("cold", "same question")
    b = make_messages("cold", "same question")
    # the salt opens the conversation as its own system message (else templates insert a shared default)
    assert a[0]["role"] == "system" and a[0]["content"] != b[0]["content"] and a[0]["content"].startswith("[")
    assert a[1] == b[1] == {"role": "user", "content": "same question"}
    assert make_messages("warm", "q") == make_messages("warm", "q")
    shared = [make_messages("shared-prefix", f"tail {i}", system="common") for i in range(2)]
    assert shared[0][0] == shared[1][0] and shared[0][1] != shared[1][1]
    cold_sys = make_messages("cold", "q", system="sys")
    assert cold_sys[0]["role"] == "system" and cold_sys[0]["content"].endswith("sys") and cold_sys[0]["content"] != "sys"
    with pytest.raises(SuduError):
        make_messages("lukewarm", "q")


def test_parse_slo():
    assert parse_slo("ttft=500ms,tpot=0.05,e2e=10s") == {"ttft_s": 0.5, "tpot_s": 0.05, "e2e_s": 10.0}
    assert parse_slo(None) == {}
    for bad in ("ttft", "speed=3", "ttft=fast"):
        with pytest.raises(SuduError):
            parse_slo(bad)


def test_token_gap_allows_an_unsent_stop_token():
    assert token_gap(13, 12, "stop") == 0.0  # the server counted the stop token it never sent as text
    assert token_gap(13, 12, "length") > 0.02
    assert token_gap(100, 99, None) == pytest.approx(0.01)
    assert token_gap(100, 90, "stop") == pytest.approx(0.09)


def _ar1(rng, n, phi, mean=100.0, sd=10.0):
    noise = rng.normal(0.0, sd * np.sqrt(1 - phi ** 2), n)
    x = np.empty(n)
    x[0] = rng.normal(0.0, sd)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + noise[i]
    return mean + x


def test_intervals_respect_dependence():
    """Dependent data with a known mean: tokens per second that carry over from one second to the next
    (AR(1), phi 0.6), and per-token gaps that share their request's speed. The block and cluster
    bootstraps cover the truth at about the nominal 95% (the block bootstrap runs a little narrow, as it
    is known to); resampling the same values as independent covers it far less often."""
    rng = np.random.default_rng(11)
    trials = 200
    block = naive = 0
    for t in range(trials):
        x = _ar1(rng, 120, 0.6)
        b, i = summarize(x, seed=t, kind="block"), summarize(x, seed=t)
        block += b.ci_low <= 100.0 <= b.ci_high
        naive += i.ci_low <= 100.0 <= i.ci_high
    assert 0.84 <= block / trials <= 0.99 and naive / trials < 0.8
    cluster = naive = 0
    for t in range(trials):
        requests = [rng.normal(10.0 + rng.normal(0.0, 2.0), 1.0, size=rng.integers(20, 60)) for _ in range(20)]
        c = summarize(requests, seed=t, kind="cluster")
        i = summarize(np.concatenate(requests), seed=t)
        assert c.n == sum(len(r) for r in requests) and c.n_units == 20
        cluster += c.ci_low <= 10.0 <= c.ci_high
        naive += i.ci_low <= 10.0 <= i.ci_high
    assert 0.88 <= cluster / trials <= 0.99 and naive / trials < 0.5


def test_clustered_and_block_ratios():
    rng = np.random.default_rng(2)
    a = [rng.normal(0.02, 0.001, 30) for _ in range(15)]
    b = [rng.normal(0.01, 0.0005, 30) for _ in range(15)]
    r = ratio_ci(a, b, kind="cluster")
    assert r.ratio == pytest.approx(0.5, rel=0.05) and r.significant and r.n_a == 450
    few = ratio_ci(a[:3], b[:3], kind="cluster")
    assert few.significant is None and "3 requests < 10" in few.note
    s = summarize(_ar1(rng, 9, 0.5), kind="block")
    assert s.ci_low is None and "9 seconds" in s.note
