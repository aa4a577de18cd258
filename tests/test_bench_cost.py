"""Cost accounting: hand-computed costs for hits, misses and outputs; presets say where their figures come
from; cost per session and per task run; a machine's hourly cost spread over the run; bad --price input
refused in one line."""
import json

import pytest

from sudu.bench.client import RequestRecord
from sudu.bench.cost import cost_summary, load_preset, parse_price, preset_names, token_cost
from sudu.bench.fake_server import FakeServer
from sudu.errors import SuduError
from tests.helpers.bench_cli import run_cli


def rec(i, prompt, cached, out, session=None, task=None, t=0.0, done=1.0):
    r = RequestRecord(i, "g", "cold", session=session, task=task, t_sent_s=t, done_s=done)
    r.usage = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
               "prompt_tokens_details": {"cached_tokens": cached}}
    return r


def test_hand_computed_costs():
    p = parse_price("miss=2,hit=0.5,out=8")
    # 1000 prompt tokens of which 600 cached, 100 output: 400*2 + 600*0.5 + 100*8 = 1900 per million
    cost, nocache = token_cost({"prompt": 1000, "cached": 600, "output": 100}, p)
    assert cost == pytest.approx(1900e-6) and nocache == pytest.approx((2000 + 800) * 1e-6)
    c = cost_summary([rec(0, 1000, 600, 100, "s1"), rec(1, 1000, 0, 100, "s1"), rec(2, 500, 500, 0, "s2")],
                     p, None, None)
    t = c["tokens"]
    assert t["total"] == pytest.approx((1900 + 2800 + 250) * 1e-6)
    assert t["input_miss"] == pytest.approx(1400 * 2e-6) and t["input_hit"] == pytest.approx(1100 * 0.5e-6)
    assert t["output"] == pytest.approx(200 * 8e-6)
    nocache = (2800 + 2800 + 1000) * 1e-6
    assert t["saved_share"] == pytest.approx(1 - t["total"] / nocache)
    assert t["per_session"]["n"] == 2 and t["per_session"]["mean"] == pytest.approx((4700e-6 + 250e-6) / 2)
    assert t["tokens_per_unit"] == pytest.approx(2700 / t["total"])
    assert c["token_hit_rate"] == pytest.approx(1100 / 2500)


def test_hit_defaults_to_miss_and_tasks_are_their_own_unit():
    p = parse_price("miss=1,out=1")
    assert p.input_hit_per_mtok == 1
    c = cost_summary([rec(0, 10, 5, 1, "retrieval#0", task="retrieval"), rec(1, 10, 5, 1, "retrieval#0", task="retrieval"),
                      rec(2, 10, 5, 1, "retrieval#1", task="retrieval")], p, None, None)
    assert c["tokens"]["per_task"]["n"] == 2 and c["tokens"]["per_session"]["n"] == 0
    assert c["tokens"]["saved_share"] == 0


def test_machine_cost_spread_over_the_window():
    c = cost_summary([rec(0, 10, 0, 50, t=0.0, done=2.0), rec(1, 10, 0, 50, t=1.0, done=2.0)], None, 3.6, 3.0)
    m = c["machine"]
    assert m["total"] == pytest.approx(0.003) and m["per_request"] == pytest.approx(0.0015)
    assert m["per_million_output_tokens"] == pytest.approx(0.003 / 100 * 1e6)


def test_unpriced_requests_counted_apart():
    r = RequestRecord(5, "g", "cold")
    c = cost_summary([rec(0, 10, 0, 1), r], parse_price("miss=1,out=1"), None, None)
    assert c["requests_unpriced"] == 1 and c["requests_priced"] == 1


def test_presets_say_where_their_figures_come_from():
    names = preset_names()
    assert {"deepseek-v4-flash", "deepseek-v4-pro", "deepseek-chat-v3", "claude-opus-4.5"} <= set(names)
    for name in names:
        p = load_preset(name)
        assert p.source.startswith(("DeepSeek", "Anthropic")) and "http" in p.source and p.date
        assert 0 < p.input_hit_per_mtok < p.input_miss_per_mtok
    flash = load_preset("deepseek-v4-flash")
    assert flash.input_miss_per_mtok / flash.input_hit_per_mtok == pytest.approx(50)


@pytest.mark.parametrize("text,error", [
    ("nosuch", "unknown price preset 'nosuch'; presets: claude-opus-4.5"),
    ("miss=1", "--price needs at least miss=X and out=Z"),
    ("miss=a,out=1", "bad --price value for miss"),
    ("miss=1,out=1,foo=2", "unknown --price key 'foo'"),
    ("miss=-1,out=1", "--price miss must be >= 0"),
])
def test_bad_price(text, error):
    with pytest.raises(SuduError, match=error.replace("(", r"\(")):
        parse_price(text)


def test_cost_per_session_matches_the_usage_fields(tmp_path):
    """A conversation run priced: its per-session cost equals the usage fields summed by hand."""
    from tests.helpers.prefix_caches import PrefixCacheServer

    with FakeServer(PrefixCacheServer()) as srv:
        assert run_cli(["conversation", "--url", srv.url, "--users", "2", "--turns", "3", "--out", str(tmp_path),
                        "--no-html", "--no-progress", "--price", "miss=1,hit=0.1,out=2"]) == 0
    rep = json.load(open(next(tmp_path.glob("conversation-*.json"))))
    by_session = {}
    for r in rep["records"]:
        if r["warmup"]:
            continue
        u = r["usage"]
        cached = u["prompt_tokens_details"]["cached_tokens"]
        c = ((u["prompt_tokens"] - cached) * 1 + cached * 0.1 + u["completion_tokens"] * 2) / 1e6
        by_session[r["session"]] = by_session.get(r["session"], 0) + c
    per = rep["cost"]["tokens"]["per_session"]
    assert per["n"] == 2 and per["mean"] == pytest.approx(sum(by_session.values()) / 2)
