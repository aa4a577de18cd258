"""sudu bench capacity against a fake server with a known load -> latency curve: the search finds the knee
within 10%, confirms it, reports goodput and a Pareto curve; a target nothing meets and impossible
targets are said in one line."""
import asyncio
import json

import pytest

import sudu.bench.capacity as C
from sudu.bench.capacity import CapacityOptions, pareto, search, validate
from sudu.bench.fake_server import FakeServer, LoadLatency
from sudu.errors import SuduError
from tests.helpers.bench_cli import run_cli


def _report(tmp_path):
    return json.load(open(next(tmp_path.glob("capacity-*.json"))))


def test_search_finds_the_known_knee(tmp_path):
    # TTFT = 20 ms + 100 ms per request in flight beyond 4: p99 TTFT <= 970 ms holds up to 13 in flight, with
    # 50 ms to spare on either side (a loaded machine only adds delay: a miss by jitter lowers the answer)
    model = LoadLatency(ttft_s=0.020, ttft_slope_s=0.100, itl_s=0.005, knee=4, tokens=4)
    with FakeServer(model) as srv:
        model.server = srv
        assert run_cli(["capacity", "--url", srv.url, "--slo", "ttft=970ms,itl=200ms", "--max", "64", "-n", "16",
                        "--warmup", "0", "--out", str(tmp_path), "--no-progress", "--no-html"]) == 0
    cap = _report(tmp_path)["capacity"]
    knee = max(c for c in range(1, 64) if model.latency(c)[0] <= 0.97)
    assert knee == 13
    assert abs(cap["answer"] - knee) / knee <= 0.10, cap["answer"]
    assert len(cap["confirmations"]) == 2 and all(c["passed"] for c in cap["confirmations"])
    assert [p["load"] for p in cap["probes"][:5]] == [1, 2, 4, 8, 16]
    assert not any(p["passed"] for p in cap["probes"] if p["load"] >= knee + 2)
    assert cap["goodput_req_s"] > 0 and cap["pareto"]


async def run_level(load, label):
    return load  # stands for the level's records: the evaluator patched in below reads the load from it


def test_rate_mode_search_narrows_to_the_tolerance(monkeypatch):
    def figures(records, opts):
        ok = records <= 7.3  # a server that keeps up to 7.3 req/s
        return {"n": 10, "ok": 10, "p99_ttft_s": 0.1, "p99_itl_s": 0.01, "passed": ok, "misses": [] if ok else ["x"],
                "total_tok_s": records * 10, "requests_per_s": records, "per_user_tok_s": 50 / records,
                "goodput_req_s": records if ok else 0, "good_fraction": 1.0}

    monkeypatch.setattr(C, "level_figures", figures)
    opts = CapacityOptions("rate", ttft_p99_s=0.5, start=1, max=100, tolerance=0.05, confirm=1)
    cap = asyncio.run(search(run_level, opts))
    assert 7.3 / 1.05 <= cap["answer"] <= 7.3 and cap["first_miss"] > 7.3
    assert cap["first_miss"] / cap["answer"] - 1 <= 0.05


def test_confirmation_failure_steps_down(monkeypatch):
    seen = []

    def figures(load, opts):
        seen.append(load)
        flaky = load == 4 and len([x for x in seen if x == 4]) > 1  # 4 passes in the search, misses when confirmed
        ok = load <= 4 and not flaky
        return {"n": 8, "ok": 8, "p99_ttft_s": 0.1, "p99_itl_s": None, "passed": ok, "misses": [] if ok else ["slow"],
                "total_tok_s": load, "requests_per_s": load, "per_user_tok_s": 1.0, "goodput_req_s": load,
                "good_fraction": 1.0}

    monkeypatch.setattr(C, "level_figures", figures)
    cap = asyncio.run(search(run_level, CapacityOptions("concurrency", ttft_p99_s=1.0, max=64, confirm=1)))
    assert cap["answer"] == 3 and cap["confirmations"][0]["passed"]


def test_nothing_meets_the_target(tmp_path):
    model = LoadLatency(ttft_s=0.05, knee=100, tokens=3)
    with FakeServer(model) as srv:
        model.server = srv
        assert run_cli(["capacity", "--url", srv.url, "--slo", "ttft=10ms", "-n", "4", "--warmup", "0",
                        "--out", str(tmp_path), "--no-progress", "--no-html"]) == 0
    cap = _report(tmp_path)["capacity"]
    assert cap["answer"] is None and len(cap["probes"]) == 1 and "p99 TTFT" in cap["probes"][0]["misses"][0]


@pytest.mark.parametrize("opts,error", [
    (CapacityOptions(ttft_p99_s=0.0), "impossible SLO: ttft target must be > 0"),
    (CapacityOptions(itl_p99_s=-1.0), "impossible SLO: itl target must be > 0"),
    (CapacityOptions(), "give a target"),
    (CapacityOptions(ttft_p99_s=1, start=8, max=4), "--max >= --start"),
    (CapacityOptions(ttft_p99_s=1, start=1.5), "whole numbers"),
])
def test_impossible_targets(opts, error):
    with pytest.raises(SuduError, match=error):
        validate(opts)


def test_pareto_front():
    pts = [{"total_tok_s": 10, "per_user_tok_s": 10}, {"total_tok_s": 20, "per_user_tok_s": 8},
           {"total_tok_s": 15, "per_user_tok_s": 5}, {"total_tok_s": 30, "per_user_tok_s": 2}]
    assert [p["total_tok_s"] for p in pareto(pts)] == [10, 20, 30]
