"""`sudu bench compare`: ratios with CIs and verdicts, pass-rate differences for tasks, and a refusal,
each with its reason, for every way two reports can measure different work; --force compares anyway
and says what differed."""
import copy
import json

import numpy as np
import pytest

from sudu.bench import compare
from sudu.errors import SuduError
from tests.helpers.bench_cli import run_cli


def synthetic(ttft_values, cache_state="cold", **config):
    return {
        "schema": "sudu-bench/1", "suite": "single", "target": {"model": "m", "url": "u"}, "task_runs": [],
        "config": {"max_tokens": 64, "ignore_eos": False, "sampling": {"temperature": 0.0}, **config},
        "groups": [{"name": "single", "cache_state": cache_state, "throughput": {}, "cache_contradictions": 0,
                    "params": {"prompt_set": "chat-v1@abc"}}],
        "records": [{"group": "single", "warmup": False, "ok": True, "metrics": {"ttft_s": v}} for v in ttft_values],
    }


def test_ratio_and_significance():
    rng = np.random.default_rng(5)
    a = synthetic(list(rng.normal(0.200, 0.01, 40)))
    b = synthetic(list(rng.normal(0.100, 0.005, 40)))
    rows, diffs = compare.compare(a, b)
    row = next(r for r in rows if r["metric"] == "ttft_s")
    assert not diffs and row["ratio"] == pytest.approx(0.5, rel=0.05) and row["verdict"] == "B better"
    c = synthetic(list(rng.normal(0.200, 0.01, 40)))
    row = next(r for r in compare.compare(a, c)[0] if r["metric"] == "ttft_s")
    assert row["significant"] is False and "not significant" in row["verdict"]


def _mutations():
    def model(r):
        r["target"]["model"] = "other"

    def prompts(r):
        r["groups"][0]["params"]["prompt_set"] = "code-v2@def"

    def max_tokens(r):
        r["config"]["max_tokens"] = 128

    def ignore_eos(r):
        r["config"]["ignore_eos"] = True

    def sampling(r):
        r["config"]["sampling"] = {"temperature": 0.7}

    def cache_state(r):
        r["groups"][0]["cache_state"] = "warm"

    def one_side_only(r):
        r["groups"].append({**r["groups"][0], "name": "extra"})

    def contradiction(r):
        r["groups"][0]["cache_contradictions"] = 3

    def suite(r):
        r["suite"] = "throughput"

    return {"model": (model, "model"), "prompt set": (prompts, "prompt set"), "max_tokens": (max_tokens, "max_tokens"),
            "ignore_eos": (ignore_eos, "ignore_eos"), "sampling": (sampling, "sampling"),
            "cache state": (cache_state, "cache state"), "one side only": (one_side_only, "in B only"),
            "contradiction": (contradiction, "flagged cache contradictions"), "suite": (suite, "suite")}


@pytest.mark.parametrize("name", list(_mutations()))
def test_each_difference_is_refused_and_force_says_it(name, tmp_path, capsys):
    mutate, reason = _mutations()[name]
    a = synthetic([0.2] * 10 + [0.21] * 10)
    b = copy.deepcopy(a)
    mutate(b)
    with pytest.raises(SuduError, match="refusing") as exc:
        compare.compare(a, b)
    assert reason in str(exc.value)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    with pytest.raises(SuduError, match=reason):
        run_cli(["compare", str(pa), str(pb)])
    assert run_cli(["compare", str(pa), str(pb), "--force"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("FORCED") and reason in out.split("\nA:")[0]


def test_same_work_is_not_refused_and_bad_files_are():
    a = synthetic([0.2] * 20)
    assert compare.compare(a, copy.deepcopy(a))[1] == []
    with pytest.raises(SuduError, match="cannot read report"):
        compare.load("/nonexistent.json")


def test_task_pass_rates_side_by_side():
    def tasks(first, passed):
        r = synthetic([0.1] * 10)
        r["suite"] = "tasks"
        r["task_runs"] = [{"task": "sql", "passed": p, "passed_first": f, "task_time_s": 1.0 if p else None}
                          for f, p in zip(first, passed)]
        return r

    a = tasks([False] * 20, [True] * 10 + [False] * 10)
    b = tasks([True] * 20, [True] * 20)
    rates = {r["metric"]: r for r in compare.pass_rates(a, b)}
    assert rates["pass@1"]["difference"] == 1.0 and rates["pass@1"]["verdict"] == "B better"
    assert rates["pass"]["rate_a"] == 0.5 and rates["pass"]["ci_low"] > 0
    few = compare.pass_rates(tasks([True] * 3, [True] * 3), tasks([True] * 3, [True] * 3))
    assert "too few samples" in few[0]["verdict"]
