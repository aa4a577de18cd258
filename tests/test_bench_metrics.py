"""sudu bench's run-level formulas (throughput, peak, goodput, meets_slo) on hand-built records whose
answers are worked out by hand in the comments: two completed streams, one stream that failed partway,
one request that failed before any chunk, and a warm-up request that must not count."""
import pytest

from sudu.bench.client import RequestRecord
from sudu.bench.metrics import goodput, meets_slo, request_metrics, throughput


def record(request_id, t_sent_s, chunk_times_s, server_tokens=None, completion_tokens=None, done_s=None,
           status=200, error=None, warmup=False):
    rec = RequestRecord(request_id=request_id, group="g", cache_state="cold", warmup=warmup, t_sent_s=t_sent_s,
                        status=status, error=error, chunk_times_s=list(chunk_times_s), done_s=done_s,
                        chunk_chars=[5] * len(chunk_times_s))
    if server_tokens is not None:
        rec.chunk_tokens_server, rec.chunk_server_kind = list(server_tokens), "usage"
    if completion_tokens is not None:
        rec.usage = {"prompt_tokens": 10, "completion_tokens": completion_tokens}
    rec.metrics = request_metrics(rec)
    return rec


def run():
    return [
        # warm-up, long before the window: excluded everywhere
        record(0, -10.0, [0.1, 0.2], completion_tokens=50, done_s=0.2, warmup=True),
        # sent at 0; 4 chunks of one token (usage 4 spread over 4 chunks) at 0.5, 1.0, 1.5, 2.0; body read at 2.5
        record(1, 0.0, [0.5, 1.0, 1.5, 2.0], completion_tokens=4, done_s=2.5),
        # sent at 0.5; the server counts 2 tokens per chunk (at 0.75, 1.25, 1.75 absolute) and 7 in usage
        # (one stop token sent as no text): each chunk weighs 7/6 * 2 = 7/3
        record(2, 0.5, [0.25, 0.75, 1.25], server_tokens=[2, 2, 2], completion_tokens=7, done_s=1.25),
        # sent at 1.0; one chunk of 3 tokens at 1.5, then the connection broke
        record(3, 1.0, [0.5], server_tokens=[3], status=200, error="connection reset"),
        # sent at 1.5; a 500 before any chunk
        record(4, 1.5, [], status=500, error="server error"),
    ]


def test_per_request_figures():
    recs = run()
    r1, r2 = recs[1].metrics, recs[2].metrics
    assert r1["ttft_s"] == 0.5 and r1["e2e_s"] == 2.0 and r1["output_tokens"] == 4
    assert r1["tpot_s"] == pytest.approx(1.5 / 3) and r1["itl_s"] == pytest.approx([0.5, 0.5, 0.5])
    assert r2["tpot_s"] == pytest.approx(1.0 / 4) and r2["itl_s"] == pytest.approx([0.25] * 4)
    assert r2["output_tokens"] == 7 and r2["chunk_tokens"] == 6


def test_throughput_mean_and_peak():
    res = throughput(run())
    # window: first measured send (0.0) -> last end (request 1's body at 2.5) = 2.5 s; the failed request
    # 4 has no chunks, so it only moves the start, not the end
    assert res["window_s"] == pytest.approx(2.5)
    assert res["n_requests"] == 2 and res["output_tokens"] == 4 + 7
    assert res["mean_tok_s"] == pytest.approx(11 / 2.5) and res["requests_per_s"] == pytest.approx(2 / 2.5)
    assert res["failed_streams"] == 1 and res["failed_stream_tokens"] == 3
    # token events: 0.5:1, 0.75:7/3, 1.0:1, 1.25:7/3, 1.5:1, 1.75:7/3, 2.0:1; the best window of 1 s
    # holds two of each kind: 2 + 14/3 = 20/3 (the failed stream's 3 tokens at 1.5 are not in it)
    assert res["peak_tok_s"] == pytest.approx(20 / 3)
    # whole seconds only: [0, 1) holds 1 + 7/3, [1, 2) holds 2 + 14/3; the half second left is dropped
    assert res["per_second_tok"] == pytest.approx([10 / 3, 20 / 3])


def test_no_peak_from_a_window_shorter_than_a_second():
    res = throughput([record(1, 0.0, [0.1, 0.2, 0.3], completion_tokens=3, done_s=0.4)])
    assert res["mean_tok_s"] == pytest.approx(3 / 0.4) and res["peak_tok_s"] is None
    assert throughput([record(1, 0.0, [], status=500, error="x")]) == {"n_requests": 0}


def test_goodput_counts_slo_misses_and_failures():
    recs = run()
    # request 1 misses e2e (2.0 > 1.5), request 2 meets both, requests 3 and 4 failed
    res = goodput(recs, {"ttft_s": 0.6, "e2e_s": 1.5}, window_s=2.5)
    assert res["good_requests"] == 1 and res["total_requests"] == 4
    assert res["fraction"] == pytest.approx(0.25) and res["goodput_req_s"] == pytest.approx(1 / 2.5)
    # a TTFT limit under request 2's 0.25 s leaves none; limits above everything keep both completed
    assert goodput(recs, {"ttft_s": 0.2}, 2.5)["good_requests"] == 0
    assert goodput(recs, {"ttft_s": 1.0, "e2e_s": 3.0, "tpot_s": 0.5, "itl_s": 0.5}, 2.5)["good_requests"] == 2
    assert goodput(recs, {}, 2.5) is None


def test_meets_slo_limits():
    m = {"ok": True, "ttft_s": 0.3, "tpot_s": 0.05, "e2e_s": 2.0, "itl_s": [0.04, 0.09, 0.05]}
    assert meets_slo(m, {"ttft_s": 0.3, "tpot_s": 0.05, "e2e_s": 2.0, "itl_s": 0.09})  # a limit is inclusive
    assert not meets_slo(m, {"ttft_s": 0.29})
    assert not meets_slo(m, {"tpot_s": 0.049})
    assert not meets_slo(m, {"e2e_s": 1.9})
    assert not meets_slo(m, {"itl_s": 0.08})  # the worst gap counts, not the mean (0.06)
    assert not meets_slo(dict(m, ok=False), {})
    # a figure the request has none of (one chunk: no TPOT, no gaps) cannot miss its limit
    assert meets_slo({"ok": True, "ttft_s": 0.1, "itl_s": []}, {"tpot_s": 0.01, "itl_s": 0.01})
