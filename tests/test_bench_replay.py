"""sudu bench replay: traces load (sudu JSONL and Mooncake's format) and bad ones are refused with the line
that is wrong; prompts synthesized from hash ids share exactly the blocks the trace says; against a fake
server with an ideal prefix cache, a 20-session x 8-turn trace reaches the trace's ideal hit rate, and
the server's own log shows every dependency and tool wait respected; open and closed loop, --speedup."""
import json

import pytest

from sudu.bench.fake_server import FakeServer
from sudu.bench.replay import PromptSynth, single_token_words
from sudu.bench.trace import TraceRequest, ideal_hit_rate, load_trace, synthetic_sessions, write_jsonl
from sudu.errors import SuduError
from tests.helpers.bench_cli import run_cli
from tests.helpers.prefix_caches import PrefixCache



def _report(tmp_path, suite="replay"):
    return json.load(open(sorted(tmp_path.glob(f"{suite}-*.json"))[-1]))


def test_synthesized_prompts_share_exactly_the_blocks_of_equal_hash_ids():
    synth = PromptSynth(8, seed=1)
    a = TraceRequest(0, "a", "s", None, 0.0, None, 0.0, 20, [1, 2, 3], 4)
    b = TraceRequest(1, "b", "s", None, 0.0, None, 0.0, 24, [1, 2, 9], 4)
    wa, wb = synth.prompt(a).split(" ")[1:], synth.prompt(b).split(" ")[1:]
    assert len(wa) == 20 and len(wb) == 24  # one word per token, the partial block cut
    assert wa[:16] == wb[:16] and wa[16:20] != wb[16:20]


def test_synthesized_prompts_are_token_exact_on_the_models_tokenizer(tiny_model_dirs):
    # the tiny model's 384-token vocabulary has few common English words: its own word tokens are used
    from sudu.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dirs["llama"])
    words = single_token_words(tok)
    assert len(words) >= 5 and all(len(tok.encode(" " + w, add_special_tokens=False)) == 1 for w in words)
    synth = PromptSynth(16, words=words)
    req = TraceRequest(0, "a", "s", None, 0.0, None, 0.0, 40, [1, 2, 3], 4)
    assert len(tok.encode(synth.prompt(req), add_special_tokens=False)) == 40


def test_mooncake_format_loads(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 12, "hash_ids": [0, 1, 2]}\n'
                    '{"timestamp": 500, "input_length": 1030, "output_length": 8, "hash_ids": [0, 1, 3]}\n'
                    '{"timestamp": 1500, "input_length": 600, "output_length": 8, "hash_ids": [4, 5]}\n')
    trace = load_trace(str(path))
    assert trace.format == "mooncake" and trace.block_size == 512
    assert [r.at_s for r in trace.requests] == [0.0, 0.5, 1.5] and all(r.after is None for r in trace.requests)
    # the second request reuses blocks 0 and 1 (1024 of its 1030 tokens)
    assert ideal_hit_rate(trace) == pytest.approx(1024 / (1100 + 1030 + 600))


@pytest.mark.parametrize("content,error", [
    ("not json\n", "line 1: not JSON"),
    ('{"input_length": 10, "output_length": 2}\n', "'hash_ids' must be a list of integers"),
    ('{"input_length": 1000, "output_length": 2, "hash_ids": [1]}\n', "1 hash_ids for input_length 1000; 512-token blocks need 2"),
    ('{"input_length": 10, "output_length": 2, "hash_ids": [1], "after": "x"}\n', "'after' names 'x'"),
    ('{"input_length": -1, "output_length": 2, "hash_ids": []}\n', "'input_length' must be >= 1"),
    ('{"sudu_trace": 1, "block_size": 0}\n', "'block_size' must be >= 1"),
    ("\n", "has no requests"),
])
def test_bad_traces_refused_with_their_line(tmp_path, content, error):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(SuduError, match=error.replace("(", r"\(").replace("[", r"\[")):
        load_trace(str(path))


def test_unreadable_trace(tmp_path):
    with pytest.raises(SuduError, match="cannot read trace .*missing.jsonl: No such file"):
        load_trace(str(tmp_path / "missing.jsonl"))
    with pytest.raises(SuduError, match="cannot read trace"):
        load_trace(str(tmp_path))


def test_sessions_chain_implicitly(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(synthetic_sessions(sessions=2, turns=3, teams=1, block_size=8, system_blocks=2), str(path))
    trace = load_trace(str(path))
    assert trace.block_size == 8 and trace.sessions == ["s0", "s1"]
    assert [r.after for r in trace.requests] == [None, 0, 1, None, 3, 4]
    assert [r.id for r in trace.requests[:2]] == ["s0/1", "s0/2"]


def test_replay_20_sessions_8_turns_reaches_the_ideal_and_keeps_every_dependency(tmp_path):
    trace_path = tmp_path / "agents.jsonl"
    write_jsonl(synthetic_sessions(sessions=20, turns=8, teams=4, block_size=64, system_blocks=4, blocks_per_turn=2,
                                   output_length=4, tool_wait_s=1.0, arrival_gap_s=0.5, seed=3), str(trace_path))
    trace = load_trace(str(trace_path))
    speedup = 20.0
    with FakeServer(PrefixCache()) as srv:
        assert run_cli(["replay", str(trace_path), "--url", srv.url, "--speedup", str(speedup), "--out", str(tmp_path),
                        "--no-html", "--no-progress", "--chunk-usage", "off"]) == 0
        log = [e for e in srv.log if e["path"] == "/v1/completions"]
    rep = _report(tmp_path)
    rp = rep["replay"]
    assert rp["requests_ok"] == 160 and rp["sessions"] == 20 and rp["ideal_hit_rate"] > 0.6
    assert abs(rp["hit_rate_gap_points"]) <= 2.0, rp
    assert rp["ideal_hit_rate_computed"] <= rp["ideal_hit_rate"]
    assert rp["prompt_token_excess_mean"] == 0  # token-exact prompts over completions
    assert rp["dependency_violations"] == []
    # the server's own clock: each dependent request was read only after its dependency was answered,
    # plus the tool wait (scaled by the speedup)
    assert len(log) == 160
    by_prompt = {}
    for e in log:
        by_prompt.setdefault(e["body"]["prompt"], e)
    synth = PromptSynth(trace.block_size, seed=0)
    checked = 0
    for req in trace.requests:
        if req.after is None:
            continue
        mine, dep = by_prompt[synth.prompt(req)], by_prompt[synth.prompt(trace.requests[req.after])]
        assert mine["read_at"] >= dep["done_at"] + req.tool_wait_s / speedup, req.id
        checked += 1
    assert checked == 140
    assert all(e["body"]["ignore_eos"] and e["body"]["max_tokens"] == 4 for e in log)
    # every session's requests carry its session: the unit of cost per session
    sessions = {r["session"] for r in rep["records"] if not r["warmup"]}
    assert len(sessions) == 20


def test_closed_loop_keeps_sessions_in_flight_below_the_limit(tmp_path):
    trace_path = tmp_path / "agents.jsonl"
    write_jsonl(synthetic_sessions(sessions=6, turns=3, teams=2, block_size=16, tool_wait_s=0.2, seed=1), str(trace_path))
    with FakeServer(PrefixCache(answer_s=0.01)) as srv:
        assert run_cli(["replay", str(trace_path), "--url", srv.url, "--mode", "closed", "--concurrency", "2",
                        "--speedup", "10", "--out", str(tmp_path), "--no-html", "--no-progress",
                        "--chunk-usage", "off"]) == 0
    rp = _report(tmp_path)["replay"]
    spans = [(s["start_s"], s["end_s"]) for s in rp["session_runs"]]
    for t, _ in spans:  # at any session start, at most 2 sessions are running
        assert sum(1 for a, b in spans if a <= t < b) <= 2
    assert rp["requests_ok"] == 18 and rp["dependency_violations"] == []


def test_replay_over_chat_counts_the_template_overhead(tmp_path):
    trace_path = tmp_path / "t.jsonl"
    write_jsonl(synthetic_sessions(sessions=2, turns=2, teams=1, block_size=16, tool_wait_s=0.0), str(trace_path))
    with FakeServer(PrefixCache()) as srv:
        assert run_cli(["replay", str(trace_path), "--url", srv.url, "--api", "chat", "--out", str(tmp_path),
                        "--no-html", "--no-progress", "--chunk-usage", "off", "--price", "deepseek-v4-flash"]) == 0
        assert {e["path"] for e in srv.log} == {"/v1/chat/completions"}
    rep = _report(tmp_path)
    assert rep["replay"]["requests_ok"] == 4 and rep["cost"]["tokens"]["per_session"]["n"] == 2


def test_json_lines_stream_every_request_as_it_finishes(tmp_path):
    trace_path = tmp_path / "t.jsonl"
    write_jsonl(synthetic_sessions(sessions=3, turns=2, teams=1, block_size=16, tool_wait_s=0.0), str(trace_path))
    lines_path = tmp_path / "records.jsonl"
    with FakeServer(PrefixCache()) as srv:
        assert run_cli(["replay", str(trace_path), "--url", srv.url, "--out", str(tmp_path), "--no-html",
                        "--no-progress", "--json-lines", str(lines_path)]) == 0
    lines = [json.loads(x) for x in lines_path.read_text().splitlines()]
    rep = _report(tmp_path)
    assert sorted(x["request_id"] for x in lines) == sorted(r["request_id"] for r in rep["records"])
    measured = [x for x in lines if not x["warmup"]]
    assert len(measured) == 6 and all(x["ok"] and x["session"] for x in measured)
    # in the order they finished
    ends = [x["t_sent_s"] + x["done_s"] for x in lines]
    assert ends == sorted(ends)
