"""The client's self-test runs and reports its figures (requests/s, TTFT against an instant server).
Only a loose sanity bound here; the >= 500 req/s and <= 1 ms figures come from
benchmarks/bench_client_overhead.py (docs/bench.md)."""
from sudu.bench.overhead import run_overhead


def test_overhead_self_test_reports_figures():
    res = run_overhead(n_latency=30, n_rate=300, concurrency=32)
    assert res["failed"] == 0
    assert res["requests_per_s"] > 20  # loose: a shared CI machine can be very busy
    assert res["ttft_ms"]["n"] == 30 and 0 < res["ttft_ms"]["median"] < 100
    assert set(res) >= {"ttft_budget_ms", "rate_target_req_s", "meets_targets", "note"}
