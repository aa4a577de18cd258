"""`sudu bench sweep`: the figures against hand-computed answers (tok/s, t intervals), two fake endpoints
with known prefill and decode times and cache behaviour measured side by side, and a tiny real sudu
server at small depths."""
from __future__ import annotations

import json
import math
import os

import pytest

from sudu.bench.client import RequestRecord
from sudu.bench.fake_server import FakeServer, chat_script
from sudu.bench.metrics import request_metrics
from sudu.bench.stats import t_interval
from sudu.bench.sweep import parse_depths, parse_endpoints
from sudu.bench.sweep_report import describe, request_figures
from sudu.errors import SuduError
from tests.helpers.bench_cli import read_report, run_cli

T_975_2DF = 4.302652729911275  # Student's t, 97.5% quantile, 2 degrees of freedom (tables)


def test_t_interval_by_hand():
    low, high = t_interval([1.0, 2.0, 3.0])  # mean 2, s = 1
    assert low == pytest.approx(2 - T_975_2DF / math.sqrt(3)) and high == pytest.approx(2 + T_975_2DF / math.sqrt(3))
    assert t_interval([5.0]) == (None, None)
    d = describe([500.0, 300.0, 400.0])
    assert (d["n"], d["mean"], d["median"], d["min"], d["max"]) == (3, 400.0, 400.0, 300.0, 500.0)
    assert d["ci_high"] == pytest.approx(400 + T_975_2DF * 100 / math.sqrt(3))


def test_request_figures_by_hand():
    rec = RequestRecord(request_id=0, group="cold depth=1000", cache_state="cold", status=200,
                        chunk_times_s=[2.0 + 0.1 * i for i in range(10)], chunk_chars=[3] * 10,
                        chunk_tokens_server=[None] * 10,
                        usage={"prompt_tokens": 1000, "completion_tokens": 10,
                               "prompt_tokens_details": {"cached_tokens": 200}})
    rec.metrics = request_metrics(rec)
    f = request_figures(rec)
    assert f["new_tokens"] == 800 and f["ttft_s"] == 2.0
    assert f["prompt_tok_s"] == pytest.approx(400.0)  # 800 uncached tokens in 2 s
    assert f["decode_tok_s"] == pytest.approx(10.0)  # 9 tokens after the first in 0.9 s


def test_parse_depths_and_endpoints():
    assert parse_depths("2k, 8k,512,0.5k") == [2000, 8000, 512, 500]
    for bad in ("2x", "", "0", "1.5"):
        with pytest.raises(SuduError):
            parse_depths(bad)
    eps = parse_endpoints(["http://a:1/v1", "http://b:2"], None, ["m"])
    assert [(e.label, e.model) for e in eps] == [("a:1", "m"), ("b:2", "m")]
    with pytest.raises(SuduError, match="one --label per --url"):
        parse_endpoints(["http://a:1", "http://b:2"], ["x"], None)


class FakeDepthServer:
    """Prompt tokens = whitespace words of the messages + 10 (the template); TTFT = 5 ms + `prefill_s` per
    uncached token; then `decode` tokens `itl_s` apart. With `caching`, a system message seen before is
    served from a cache: its tokens are reported as cached and cost nothing."""

    def __init__(self, prefill_s: float, itl_s: float, caching: bool):
        self.prefill_s, self.itl_s, self.caching = prefill_s, itl_s, caching
        self.seen: set[str] = set()

    def __call__(self, body: dict):
        system = body["messages"][0]["content"]
        words = sum(len(m["content"].split()) for m in body["messages"])
        prompt = words + 10
        cached = len(system.split()) if self.caching and system in self.seen else 0
        self.seen.add(system)
        ttft = 0.005 + self.prefill_s * (prompt - cached)
        n = body["max_tokens"]
        pieces = [(ttft + i * self.itl_s, f" w{i}") for i in range(n)]
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        return chat_script(pieces, usage=usage, model=body.get("model", "fake"))


def test_two_fake_endpoints_side_by_side(tmp_path):
    fast, slow = FakeDepthServer(0.0002, 0.004, caching=True), FakeDepthServer(0.0004, 0.008, caching=False)
    with FakeServer(fast) as a, FakeServer(slow) as b:
        assert run_cli(["sweep", "--url", a.url, "--label", "fast", "--url", b.url, "--label", "slow",
                        "--depths", "300,900", "--repeats", "2", "--decode-tokens", "6", "--new-tokens", "40",
                        "--out", str(tmp_path)]) == 0
        # ignore_eos sent; the cold prompts' salt comes first
        assert all(r.get("ignore_eos") for r in a.requests + b.requests)
        cold = [r for r in a.requests if r["messages"][-1]["content"].startswith("Continue")]
        assert len({r["messages"][0]["content"][:34] for r in cold}) == len(cold)
    path, report = read_report(tmp_path, "sweep")
    assert report["schema"] == "sudu-bench-sweep/1" and len(report["records"]) == 16
    pts = {(p["endpoint"], p["mode"], p["depth"]): p for p in report["points"]}
    assert len(pts) == 8 and all(p["n_ok"] == 2 for p in pts.values())
    for (label, mode, depth), p in pts.items():
        f = p["figures"]
        per_token, itl = (0.0002, 0.004) if label == "fast" else (0.0004, 0.008)
        if mode == "cold":  # calibration sized the prompts from usage
            assert abs(f["prompt_tokens"]["mean"] - depth) <= 0.05 * depth
            assert not p["flags"]
        # the client sees the first token no sooner than the server sends it: tok/s at most the scripted speed
        # (uncached tokens / (5 ms + their prefill)), and not far below it
        for rec in (r for r in report["records"] if r["endpoint"] == label and r["mode"] == mode and r["depth"] == depth):
            new = rec["usage"]["prompt_tokens"] - rec["usage"]["prompt_tokens_details"]["cached_tokens"]
            scripted = new / (0.005 + per_token * new)
            got = new / rec["metrics"]["ttft_s"]
            assert scripted / 3 < got <= scripted * 1.001
        # (a late first chunk on the client's side shortens the span it measures: some slack above)
        assert 1 / itl / 3 < f["decode_tok_s"]["mean"] <= 1 / itl * 1.5
        assert f["prompt_tok_s"]["ci_low"] is not None  # two repetitions: a t interval
    assert pts[("fast", "agent", 900)]["cache"] == {"hit": 2} and not pts[("fast", "agent", 900)]["flags"]
    assert pts[("slow", "agent", 900)]["cache"] == {"miss": 2}
    assert "missed the cache" in pts[("slow", "agent", 900)]["flags"][0]
    # the agent turn's new tokens: about --new-tokens past the cached prefix
    # (40 filler words and the 9-word question after them, 10 template tokens)
    assert pts[("fast", "agent", 900)]["figures"]["new_tokens"]["mean"] == 59
    md = open(path[:-5] + ".md").read()
    assert "| fast | cold | 900 |" in md and "| slow | agent | 300 |" in md and os.path.exists(path[:-5] + ".png")


def test_bad_flags_are_one_line_errors(tmp_path):
    for argv, msg in ((["--modes", "warm"], "bad --modes"), (["--depths", "8q"], "bad depth"),
                      (["--decode-tokens", "1"], "--decode-tokens >= 2")):
        with pytest.raises(SuduError, match=msg):
            run_cli(["sweep", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)] + argv)
    with pytest.raises(SuduError, match="cannot reach"):
        run_cli(["sweep", "--url", "http://127.0.0.1:9", "--depths", "100", "--out", str(tmp_path)])


def test_tiny_sudu_server(tmp_path):
    from tests.helpers.live_server import tiny_engine_server
    from tests.helpers.tiny_models import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "qwen2", seed=3)
    with tiny_engine_server(model_dir, "tiny") as server:
        assert run_cli(["sweep", "--url", server.url, "--label", "sudu", "--depths", "256,512", "--repeats", "1",
                        "--decode-tokens", "4", "--new-tokens", "32", "--out", str(tmp_path / "out")]) == 0
    _, report = read_report(tmp_path / "out", "sweep")
    pts = {(p["mode"], p["depth"]): p for p in report["points"]}
    assert set(pts) == {("cold", 256), ("cold", 512), ("agent", 256), ("agent", 512)}
    for (mode, depth), p in pts.items():
        assert p["n_ok"] == 1 and not p["flags"], p
        rec = next(r for r in report["records"] if r["mode"] == mode and r["depth"] == depth)
        assert rec["usage"]["completion_tokens"] == 4  # ignore_eos: every decode token asked for
        if mode == "agent":
            assert p["cache"] == {"hit": 1}
        else:
            assert rec["metrics"]["cached_tokens"] <= 16
    json.dumps(report)
