"""The client's timestamps and metric formulas against a scripted fake server: TTFT, TPOT, ITL and E2E
computed by sudu bench must equal the truth within 2 ms, across role-only first chunks, multi-token
chunks (told by logprobs or by a running usage), a multi-token first chunk, missing usage, an error
mid-stream and a slow first byte.

The truth is computed here, by `truth()`, from the script's token counts and from when the fake server
actually sent each chunk (it logs that on the same clock; a busy machine can make it miss its script by
milliseconds, and the script's offsets are checked against that log separately). `truth()` shares no
code with sudu.bench.metrics, so a wrong formula there cannot agree with it: a test plants one (a
multi-token chunk counted as a single gap) and asserts the check fails."""
import asyncio
import statistics

import pytest

from sudu.bench import metrics
from sudu.bench.client import ClientPool, RequestRecord, auth_headers, chat_body, parse_server_timing, stream_chat
from sudu.bench.fake_server import Event, FakeServer, ScriptedResponse, chat_script
from sudu.bench.metrics import request_metrics

TOL_S = 0.002
USAGE5 = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
SUDU = {"queue_s": 0.002, "prefill_s": 0.030, "decode_s": 0.040, "cached_tokens": 0, "acceptance_rate": 0.75,
        "mean_accepted_len": 2.5}

# model name -> (script, tokens per content chunk as the script means them)
SCRIPTS = {
    # role-only first chunk at 5 ms must not count as the first token
    "plain": (chat_script([(0.040, "a"), (0.050, "b"), (0.060, "c"), (0.070, "d"), (0.080, "e")],
                          role_at_s=0.005, usage=USAGE5, sudu=SUDU,
                          headers={"Server-Timing": "queue;dur=2, prefill;dur=30, decode;dur=40"}), [1] * 5),
    # chunks carrying several tokens, told by logprobs entries: 1 + 3 + 2 = 6 tokens
    "multi": (chat_script([(0.030, "x"), (0.060, "yyy"), (0.070, "zz")], role_at_s=0.0, logprob_tokens=[1, 3, 2],
                          usage={"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}), [1, 3, 2]),
    # the same told by a running usage; the final usage also counts the stop token (no text): 7
    "running": (chat_script([(0.030, "x"), (0.060, "yyy"), (0.070, "zz")], role_at_s=0.0,
                            continuous_usage_tokens=[1, 3, 2],
                            usage={"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}), [1, 3, 2]),
    # the first content chunk carries 3 tokens: TPOT is over the 3 tokens after it, not 5
    "bigfirst": (chat_script([(0.030, "abc"), (0.050, "d"), (0.060, "e"), (0.080, "f")], role_at_s=0.0,
                             logprob_tokens=[3, 1, 1, 1],
                             usage={"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}), [3, 1, 1, 1]),
    # no usage chunk at all and no tokenizer: one token per chunk, as the record says
    "nousage": (chat_script([(0.020, "p"), (0.030, "q"), (0.045, "r")], role_at_s=0.0, usage=None), [1, 1, 1]),
    # nothing (not even headers) for 60 ms, then content at 70 ms
    "slowbyte": (chat_script([(0.070, "s"), (0.080, "t")], role_at_s=0.065, headers_at_s=0.060,
                             usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}), [1, 1]),
    # an error object mid-stream, then the connection dropped
    "error": (ScriptedResponse(events=[
        Event(0.0, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        Event(0.020, {"choices": [{"index": 0, "delta": {"content": "ok"}}]}),
        Event(0.030, {"error": {"message": "engine crashed", "type": "server_error"}}),
    ], abort_after_events=True), [1]),
    "drop": (ScriptedResponse(events=[Event(0.010, {"choices": [{"index": 0, "delta": {"content": "ok"}}]})],
                              abort_after_events=True), [1]),
    "http500": (ScriptedResponse(status=500, body=b'{"error": {"message": "boom"}}'), []),
}


def truth(times: list[float], tokens: list[int]) -> dict:
    """The definitions of docs/metrics.md, written out again: TTFT = first content chunk, E2E = last,
    TPOT = the time after the first chunk over the tokens after it, ITL = each chunk's gap spread over
    its tokens."""
    out = {"ttft_s": times[0], "e2e_s": times[-1], "itl_s": []}
    later = sum(tokens) - tokens[0]
    if later:
        out["tpot_s"] = (times[-1] - times[0]) / later
    for i in range(1, len(times)):
        out["itl_s"] += [(times[i] - times[i - 1]) / tokens[i]] * tokens[i]
    return out


@pytest.fixture(scope="module")
def server():
    with FakeServer(lambda body: SCRIPTS[body["model"]][0]) as srv:
        yield srv


def content_events(model: str) -> list[int]:
    events = SCRIPTS[model][0].events
    return [i for i, e in enumerate(events) if isinstance(e.data, dict)
            and any((c.get("delta") or {}).get("content") for c in e.data.get("choices") or ())]


def fetch(server, model, repeats=6):
    """Send `repeats` requests (the first one opens the connection and is dropped, like a warm-up).
    Returns [(record, truth from when the server actually sent each content chunk, scripted truth)]."""
    first = len(server.read_at)

    async def go():
        out = []
        async with ClientPool(30) as pool:
            for i in range(repeats):
                rec = RequestRecord(i, "g", "cold")
                async with pool.acquire() as client:
                    await stream_chat(client, server.url, chat_body(model, [{"role": "user", "content": "hi"}], 16),
                                      auth_headers(None), rec)
                rec.metrics = request_metrics(rec)
                out.append(rec)
        return out

    recs = asyncio.run(go())
    script, tokens = SCRIPTS[model]
    content = content_events(model)
    scripted = truth([script.events[i].at_s for i in content], tokens) if content else None
    rows = []
    for rec, read_at, sent in zip(recs, server.read_at[first:], server.sent_at_s[first:]):
        times = [read_at + sent[i] - rec.t_sent_s for i in content if i < len(sent)]
        t = truth(times, tokens[: len(times)]) if times else None
        if t is not None:
            rec.metrics["first_byte_s"] = rec.first_byte_s
            t["first_byte_s"] = read_at + sent[0] - rec.t_sent_s
        rows.append((rec, t, scripted))
    return rows[1:]


def median(values):
    if isinstance(values[0], list):
        return [statistics.median(v[i] for v in values) for i in range(len(values[0]))]
    return statistics.median(values)


def close(a, b, tol) -> bool:
    return a == pytest.approx(b, abs=tol)


KEYS = {"ttft_s": TOL_S, "e2e_s": TOL_S, "tpot_s": TOL_S / 2, "itl_s": TOL_S, "first_byte_s": TOL_S}


def difference(got, want):
    if isinstance(want, list):
        return [g - w for g, w in zip(got, want)] if len(got) == len(want) else [float("inf")]
    return got - want


def checked(server, model, rounds: int = 5) -> list:
    """Records of a round in which, for every metric, the median over requests of (client's figure -
    the truth from the server's send log for that request) is within the tolerance (the loopback
    delivery delay is all that may differ); fails when no round passes."""
    for _ in range(rounds):
        rows = fetch(server, model)
        keys = [k for k in KEYS if k in rows[0][1]]
        diffs = {k: median([difference(rec.metrics.get(k), t[k]) for rec, t, _ in rows]) for k in keys}
        if all(close(diffs[k], [0.0] * len(diffs[k]) if isinstance(diffs[k], list) else 0.0, KEYS[k]) for k in keys):
            return [rec for rec, _, _ in rows]
    example = {k: (rows[0][0].metrics.get(k), rows[0][1][k]) for k in keys}
    pytest.fail(f"{model}: client medians off the truth by {diffs}; e.g. (client, truth) {example}")


def test_request_body_asks_for_usage(server):
    fetch(server, "plain", repeats=2)
    body = server.requests[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert chat_body("m", [], 4, continuous_usage=True)["stream_options"] == {
        "include_usage": True, "continuous_usage_stats": True}


def test_fake_server_keeps_its_script_roughly(server):
    rows = fetch(server, "plain")
    sent = median([t["ttft_s"] for _, t, _ in rows])
    assert sent == pytest.approx(rows[0][2]["ttft_s"], abs=0.02)


def test_plain_stream(server):
    recs = checked(server, "plain")
    for rec in recs:
        m = rec.metrics
        assert rec.ok and rec.text == "abcde" and rec.chunk_tokens == [1] * 5
        assert m["output_tokens"] == 5 and m["output_tokens_source"] == "usage"
        assert rec.token_source == "usage apportioned by characters"
        # attribution: network/client = finish chunk - queue - prefill - decode
        a = m["attribution"]
        assert (a["queue_s"], a["prefill_s"], a["decode_s"]) == (0.002, 0.030, 0.040)
        assert a["network_client_s"] == pytest.approx(rec.finish_s - 0.072)
        assert m["acceptance_rate"] == 0.75 and m["mean_accepted_len"] == 2.5
        assert rec.server_timing == {"queue_s": 0.002, "prefill_s": 0.030, "decode_s": 0.040}


@pytest.mark.parametrize("model,source", [("multi", "server:logprobs"), ("running", "server:usage")])
def test_multi_token_chunks(server, model, source):
    for rec in checked(server, model):
        assert rec.chunk_tokens == [1, 3, 2] and rec.token_source == source
        assert len(rec.metrics["itl_s"]) == 5 and "chunk_token_mismatch" not in rec.metrics


def test_multi_token_first_chunk(server):
    for rec in checked(server, "bigfirst"):
        assert rec.chunk_tokens == [3, 1, 1, 1]
        assert close(rec.metrics["tpot_s"], (rec.chunk_times_s[-1] - rec.chunk_times_s[0]) / 3, 1e-9)


def test_missing_usage_counts_chunks(server):
    for rec in checked(server, "nousage"):
        assert rec.ok and rec.usage is None
        assert rec.metrics["output_tokens"] == 3
        assert rec.metrics["output_tokens_source"] == "chunks:assumed-1-per-chunk (no usage)"


def test_slow_first_byte(server):
    recs = checked(server, "slowbyte")  # first byte checked against when the server sent it
    assert median([r.first_byte_s for r in recs]) >= 0.060  # and nothing came before the script allowed


def test_error_mid_stream(server):
    for rec in checked(server, "error"):
        assert not rec.ok and "engine crashed" in rec.error


def test_connection_dropped_and_http_error(server):
    for rec, _, _ in fetch(server, "drop", repeats=2):
        assert not rec.ok and rec.error
    for rec, _, _ in fetch(server, "http500", repeats=2):
        assert rec.status == 500 and "boom" in rec.error and not rec.ok


def test_a_planted_itl_bug_fails_the_check(server, monkeypatch):
    """The bug once missed: a chunk of k tokens counted as one gap. The check must catch it."""
    def one_gap_per_chunk(times, tokens):
        return [times[i] - times[i - 1] for i in range(1, len(times))]

    monkeypatch.setattr(metrics, "itl_per_token", one_gap_per_chunk)
    with pytest.raises(pytest.fail.Exception, match="off the truth"):
        checked(server, "multi", rounds=2)


def test_a_planted_tpot_bug_fails_the_check(server, monkeypatch):
    """TPOT as if the first chunk carried one token."""
    real = metrics.request_metrics

    def first_chunk_as_one(rec):
        m = real(rec)
        m["tpot_s"] = (m["e2e_s"] - m["ttft_s"]) / (m["chunk_tokens"] - 1)
        return m

    monkeypatch.setattr("tests.test_bench_timing.request_metrics", first_chunk_as_one)
    with pytest.raises(pytest.fail.Exception, match="off the truth"):
        checked(server, "bigfirst", rounds=2)


def test_apportioning_sums_to_usage():
    assert metrics.apportion(128, [1] * 70) == [2] * 58 + [1] * 12
    for total, weights in ((128, [3, 1, 1, 7, 2]), (5, [1, 1, 1]), (2, [1, 5, 1]), (0, [1, 1])):
        got = metrics.apportion(total, weights)
        assert sum(got) == total and len(got) == len(weights)
        if total >= len(weights):
            assert min(got) >= 1


def test_parse_server_timing():
    assert parse_server_timing("queue;dur=1.5, prefill;desc=\"x\";dur=20") == {"queue_s": 0.0015, "prefill_s": 0.02}
    assert parse_server_timing(None) is None


def test_a_request_on_a_connection_closed_under_it_is_resent_and_timed_from_the_resend():
    """The server reads the second request on a kept-alive connection and closes it without an answer
    (llama-server closes after each stream, and a request can be sent in that instant): the client sends
    it once more on a new connection, times it from then, and the record says so."""

    async def go(srv):
        recs = []
        async with ClientPool(30) as pool:
            for i in range(3):
                rec = RequestRecord(i, "g", "cold")
                async with pool.acquire() as client:
                    await stream_chat(client, srv.url, chat_body("plain", [{"role": "user", "content": "hi"}], 16),
                                      auth_headers(None), rec)
                rec.metrics = request_metrics(rec)
                recs.append(rec)
        return recs

    with FakeServer(lambda body: SCRIPTS[body["model"]][0], drop_reused=1) as srv:
        recs = asyncio.run(go(srv))
        assert srv.dropped == 1 and len(srv.requests) == 3
        assert [r.resent for r in recs] == [0, 1, 0] and all(r.ok for r in recs)
        # timed from the resend (the server held the dropped attempt 50 ms): TTFT as the server sent it
        content = content_events("plain")[0]
        sent = srv.read_at[1] + srv.sent_at_s[1][content] - recs[1].t_sent_s
        assert recs[1].metrics["ttft_s"] == pytest.approx(sent, abs=TOL_S)

    from sudu.bench.report import group_summary
    from sudu.bench.suites import Group, Run

    summary = group_summary(Run("single", {}, {}, records=recs), Group("g", "cold"), {})
    assert any("sent again" in n for n in summary["notes"]), summary["notes"]
