"""The conversation suite: sessions grow turn by turn with the model's real answers and tool outputs,
teams share a system prompt (members after the leader's first answer), cache states are declared per
turn, the per-turn summary reports the cached share the server gave, and a restart happens once, after
every session finished turn K."""
import asyncio
import json
import re

from sudu.bench.client import RequestRecord
from sudu.bench.conversation import ConversationOptions, make_sessions, run_conversation, summarize
from sudu.bench.fake_server import FakeServer
from sudu.bench.suites import Ctx, Run
from tests.helpers.bench_cli import run_cli
from tests.helpers.prefix_caches import PrefixCacheServer


def test_conversation_suite_end_to_end(tmp_path):
    server = PrefixCacheServer()
    with FakeServer(server) as srv:
        code = run_cli(["conversation", "--url", srv.url, "--model", "m", "--users", "4", "--turns", "4",
                        "--team-size", "2", "--out", str(tmp_path), "--no-html", "--no-progress"])
    assert code == 0
    report = json.load(open(next(tmp_path.glob("conversation-*.json"))))
    conv = report["conversation"]
    assert [t["n"] for t in conv["turns"]] == [4, 4, 4, 4] and conv["sessions_completed"] == 4
    groups = {g["name"]: g for g in report["groups"]}
    assert groups["turn=1 cold"]["n_ok"] == 2 and groups["turn=1 shared-prefix"]["n_ok"] == 2
    assert groups["turn=3"]["cache_state"] == "warm"
    assert not [f for f in report["flags"] if "contradict" in f or "warm" in f]
    # every later turn re-sends the whole conversation so far: all of the previous prompt is a hit
    for run in conv["session_runs"]:
        t = run["turns"]
        assert all(t[k]["cached_tokens"] >= t[k - 1]["prompt_tokens"] - 1 for k in range(1, 4))
    hit = sum(t["cached_tokens"] for r in conv["session_runs"] for t in r["turns"][1:]) / sum(
        t["prompt_tokens"] for r in conv["session_runs"] for t in r["turns"][1:])
    assert abs(conv["token_hit_rate_turns_2plus"] - hit) < 1e-9 and conv["turns"][0]["cached_share"] < hit
    # a team member's first turn comes after its leader's first turn (shared-prefix is declared honestly)
    firsts = [head for head, turn in server.order if turn == 1]
    teams = {head for head, turn in server.order if turn == 2}  # (bench may send probes of its own)
    assert len(teams) == 2 and all(firsts.count(head) == 2 for head in teams)
    # histories grow with the model's answers and tool outputs
    session = conv["session_runs"][0]["turns"]
    assert session[0]["prompt_tokens"] < session[1]["prompt_tokens"] < session[3]["prompt_tokens"]


def test_sessions_are_salted_per_run_and_shared_per_team():
    a, b = make_sessions(4, 2, seed=0), make_sessions(4, 2, seed=0)
    assert a[0].system == a[1].system != a[2].system
    assert a[0].system != b[0].system  # a new salt each run: nothing from an earlier run is reused
    assert re.sub(r"^\[\w+\] ", "", a[0].system) == re.sub(r"^\[\w+\] ", "", b[0].system)
    assert '"name": "run_tests"' in a[0].system


def test_restart_happens_once_after_every_session_finished_turn_k():
    done_at_restart = []
    counts = {}

    async def send(ctx, group, state, messages, max_tokens, session=None):
        turn = sum(m["role"] == "assistant" for m in messages) + 1
        await asyncio.sleep(0.001 * (len(ctx.run.records) % 3))
        counts[turn] = counts.get(turn, 0) + 1
        rec = RequestRecord(request_id=len(ctx.run.records), group=group, cache_state=state, status=200,
                            chunk_times_s=[0.01], text=f"answer {turn}",
                            usage={"prompt_tokens": 100 * turn}, metrics={"ttft_s": 0.01, "cached_tokens": 90 * turn})
        ctx.run.records.append(rec)
        return rec

    async def restart():
        done_at_restart.append(dict(counts))

    ctx = Ctx(pool=None, base="", headers={}, model="m", run=Run("conversation", {}, {}))
    opts = ConversationOptions(users=5, turns=4, team_size=2, restart_after_turn=2)
    sessions = asyncio.run(run_conversation(ctx, opts, send, restart))
    assert done_at_restart == [{1: 5, 2: 5}]
    assert all(s["completed"] for s in sessions)
    summary = summarize(sessions, restart_after_turn=2)
    assert [t["after_restart"] for t in summary["turns"]] == [False, False, True, False]
    assert abs(summary["token_hit_rate_turns_2plus"] - 0.9) < 1e-9
    # no answers counted (no completion_tokens): the ideal is the previous prompt, 100 (k - 1) of 100 k
    assert abs(summary["ideal_hit_rate_turns_2plus"] - (100 + 200 + 300) / (200 + 300 + 400)) < 1e-9
