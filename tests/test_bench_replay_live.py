"""Replay against sudu's own server (the real engine on a tiny random model, its prefix cache on), with
`--record-trace` recording the traffic: the replayed trace's reached hit rate is within 2 points of its
ideal, prompts are token-exact, and the recorded trace (no text) loads, infers the sessions and gives
the same ideal hit rate again."""
import json

from sudu.bench.trace import ideal_hit_rate, load_trace, synthetic_sessions, write_jsonl
from sudu.config import EngineConfig
from sudu.server.app import build_app
from sudu.server.trace_recorder import TraceRecorder
from tests.helpers.bench_cli import run_cli
from tests.helpers.live_server import LiveServer


def test_replay_on_sudu_serve_reaches_the_ideal_and_the_recorded_trace_matches(tiny_model_dirs, tmp_path):
    from sudu.engine.async_engine import AsyncLLMEngine

    trace_path, recorded = tmp_path / "agents.jsonl", tmp_path / "recorded.jsonl"
    write_jsonl(synthetic_sessions(sessions=6, turns=4, teams=2, block_size=16, system_blocks=3, blocks_per_turn=2,
                                   output_length=4, tool_wait_s=0.2, arrival_gap_s=2.0, seed=5), str(trace_path))
    config = EngineConfig(model=str(tiny_model_dirs["llama"]), max_model_len=256, max_num_seqs=16, kv_cache_memory=16 << 20)
    engine = TraceRecorder(AsyncLLMEngine(config, max_queue_len=64), str(recorded), block_size=16)
    with LiveServer(build_app(engine, served_model_name="tiny")) as live:
        assert run_cli(["replay", str(trace_path), "--url", live.url, "--tokenizer", str(tiny_model_dirs["llama"]),
                        "--speedup", "4", "--chunk-usage", "off", "--out", str(tmp_path), "--no-html",
                        "--no-progress"]) == 0
    engine.close()
    rp = json.load(open(next(tmp_path.glob("replay-*.json"))))["replay"]
    # sessions 0.5 s apart: a team's second session starts after its first one's first turn was answered
    assert rp["requests_ok"] == 24 and rp["dependency_violations"] == []
    assert rp["ideal_hit_rate"] > 0.5 and abs(rp["hit_rate_gap_points"]) <= 2.0, rp["hit_rate_gap_points"]
    assert rp["prompt_token_excess_mean"] in (0, 1)  # token-exact; 1 where the tokenizer adds BOS
    rows = [json.loads(x) for x in recorded.read_text().splitlines()]
    assert rows[0] == {"sudu_trace": 1, "block_size": 16}
    assert all("prompt" not in r and "messages" not in r for r in rows)  # lengths and hash ids only
    again = load_trace(str(recorded))
    replayed = [r for r in again.requests if r.input_length > 20]  # the bench's own short probe aside
    assert len(replayed) == 24
    # sessions inferred from prefix continuation: 6 chains of 4 turns
    assert sum(1 for r in replayed if r.after is None) == 6
    original = load_trace(str(trace_path))
    assert abs(ideal_hit_rate(again) - ideal_hit_rate(original)) < 0.03
