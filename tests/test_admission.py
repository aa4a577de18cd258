"""Admission by predicted wait and the scheduling order (engine/wait_predictor.py,
engine/schedule_policy.py, server/admission.py): the prediction against hand-computed values, the
decision and its Retry-After, the measured speed, priority with the continuing-session class and aging
(nothing starves), preemption staying exact under that order, and the 429 a client sees."""
from __future__ import annotations

import dataclasses
import random
import time

import httpx
import pytest

from sudu.engine.block_manager import BlockManager
from sudu.engine.promises import Promise, PromiseBook
from sudu.engine.schedule_policy import COLD_PENALTY, order_key
from sudu.engine.scheduler import Scheduler
from sudu.engine.sequence import Sequence
from sudu.engine.wait_predictor import (COLD_RETRY_S, EngineLoad, SeqLoad, ServiceRates, WaitModel, predict_wait,
                                        raw_wait_s)
from sudu.sampling import SamplingParams


def rates(p: float = 0.01, d: float = 0.1, output_tokens: float | None = None) -> ServiceRates:
    r = ServiceRates()
    r.prefill_s_per_token, r.decode_step_s, r.output_tokens = p, d, output_tokens
    return r


# Two slots. A and B decode (10 and 30 tokens left); C waits (100 prompt tokens, 20 to generate, cold,
# arrived at 0.8). The new request N: 50 uncached prompt tokens, cold, arrives at 1.0.
# By hand, p = 0.01 s/token, d = 0.1 s/step: A's slot frees at 1.0, B's at 3.0; C takes A's slot at 1.0
# (frees at 1.0 + 1.0 + 2.0 = 4.0); N takes B's at 3.0 and has its first token at 3.0 + 0.5 = 3.5.
# The serial prompt bound, (100 + 50) * 0.01 = 1.5, is lower.
LOAD = EngineLoad(running=(SeqLoad(0, 10, 5, tiebreak=1), SeqLoad(0, 30, 5, tiebreak=2)),
                  waiting=(SeqLoad(100, 20, 0, priority=0, continuing=False, arrival_time=0.8, tiebreak=3),))
AGING_S = 2.0


def new_request(priority: int = 0, continuing: bool = False, arrival: float = 1.0) -> SeqLoad:
    return SeqLoad(50, 10, 0, priority, continuing, arrival, tiebreak=4)


def test_prediction_equals_the_hand_computed_wait():
    wait, own, ahead = raw_wait_s(LOAD, new_request(), 2, rates(), now=1.0, aging_s=AGING_S)
    assert wait == pytest.approx(3.5) and own == pytest.approx(0.5) and ahead == 3


def test_a_more_urgent_request_is_predicted_ahead_of_the_queue():
    # priority -1 (urgency -0.5), or a continuing session's turn (0): C (urgency 0.5 - 0.2 / 2 = 0.4) is no
    # longer ahead, so N takes A's slot at 1.0: 1.0 + 0.5
    for new in (new_request(priority=-1), new_request(continuing=True)):
        wait, _, ahead = raw_wait_s(LOAD, new, 2, rates(), now=1.0, aging_s=AGING_S)
        assert wait == pytest.approx(1.5) and ahead == 2
    # ...until C has aged: at 3.0 its urgency is 0.5 - 2.2 / 2 < 0, a continuing turn arriving then is behind it
    wait, _, ahead = raw_wait_s(LOAD, new_request(continuing=True, arrival=3.0), 2, rates(), now=3.0, aging_s=AGING_S)
    assert ahead == 3


def test_expected_output_length_bounds_each_slot():
    # p = 0.001. Sequences have been generating 12 tokens on average: A and B (5 done) hold their slots
    # 7 more steps (0.7 s), not 10 and 30; C takes one at 0.7, N the other at 0.7: first token at 0.75
    # (with max_tokens as each one's length: B's slot at 3.0, so 3.05)
    wait, _, _ = raw_wait_s(LOAD, new_request(), 2, rates(p=0.001, output_tokens=12.0), now=1.0, aging_s=AGING_S)
    assert wait == pytest.approx(0.75)
    wait, _, _ = raw_wait_s(LOAD, new_request(), 2, rates(p=0.001), now=1.0, aging_s=AGING_S)
    assert wait == pytest.approx(3.05)


def test_decision_and_retry_after():
    # the limit bounds the 3.0 s spent behind others (the 0.5 s of its own prompt would come anyway)
    admitted, raw = predict_wait(LOAD, new_request(), 2, rates(), 3.0, now=1.0, aging_s=AGING_S)
    assert admitted.admitted and admitted.wait_s == pytest.approx(3.5) and raw == pytest.approx(3.5)
    assert admitted.queue_s == pytest.approx(3.0)
    refused, _ = predict_wait(LOAD, new_request(), 2, rates(), 1.5, now=1.0, aging_s=AGING_S)
    # told to come back when the 3.0 s queue ahead has drained (its turn), not at the limit's edge (1.5 s
    # sooner), so that a prediction that errs early still finds it within the limit
    assert not refused.admitted and refused.retry_after_s == 3
    calibrated = rates()
    calibrated.calibration = 2.0  # requests have been waiting twice what the model said
    refused, _ = predict_wait(LOAD, new_request(), 2, calibrated, 4.0, now=1.0, aging_s=AGING_S)
    assert refused.wait_s == pytest.approx(7.0) and refused.queue_s == pytest.approx(6.0)
    assert refused.retry_after_s == 6
    alone, _ = predict_wait(EngineLoad(), new_request(), 2, calibrated, 0.5, now=1.0, aging_s=AGING_S)
    assert alone.admitted and alone.wait_s == pytest.approx(1.0)  # a long prompt on an idle engine: admitted
    unlimited, _ = predict_wait(LOAD, new_request(), 2, calibrated, 0.0, now=1.0, aging_s=AGING_S)
    assert unlimited.admitted


def test_unmeasured_speed_admits_only_what_starts_at_once():
    cold = ServiceRates()
    one_free = EngineLoad(running=(SeqLoad(0, 10, 0),))
    assert predict_wait(one_free, new_request(), 2, cold, 5.0, now=1.0, aging_s=AGING_S)[0].admitted
    # two slots, one running and one waiting ahead: nothing free
    refused, raw = predict_wait(EngineLoad(LOAD.running[:1], LOAD.waiting), new_request(), 2, cold, 5.0, now=1.0,
                                aging_s=AGING_S)
    assert not refused.admitted and refused.wait_s is None and refused.retry_after_s == COLD_RETRY_S
    assert raw is None


def test_speed_is_measured_from_steps_and_calibrated_on_actual_waits():
    r = ServiceRates(alpha=0.2)
    assert not r.measured
    r.observe_step(num_decodes=0, num_prefill_tokens=100, seconds=1.0)  # prompt only: 0.01 s/token
    r.observe_step(num_decodes=4, num_prefill_tokens=0, seconds=0.1)  # decode only: 0.1 s/step
    assert r.measured and r.prefill_s_per_token == pytest.approx(0.01) and r.decode_step_s == pytest.approx(0.1)
    r.observe_step(num_decodes=2, num_prefill_tokens=40, seconds=0.3)  # mixed: 0.3 - 0.1 = 0.2 s for 40 tokens
    # weighed by tokens: (0.8 * 1 s + 0.2 s) / (0.8 * 100 + 40 tokens), not the two steps' rates averaged
    assert r.prefill_s_per_token == pytest.approx(1.0 / 120)
    r.observe_step(num_decodes=8, num_prefill_tokens=1, seconds=0.5)  # 0.4 s for one token: mostly noise
    assert r.prefill_s_per_token == pytest.approx(1.0 / 120)  # too few tokens to say anything: not observed
    r.observe_step(num_decodes=8, num_prefill_tokens=40, seconds=0.5)  # 0.4 s for 40 tokens
    assert r.prefill_s_per_token == pytest.approx((0.8 * 1.0 + 0.4) / (0.8 * 120 + 40))
    r.observe_wait(predicted_raw_s=1.0, actual_s=3.0)
    assert r.calibration == pytest.approx(3.0)  # one ratio: it is its own 90th percentile
    for _ in range(100):
        r.observe_wait(predicted_raw_s=1.0, actual_s=100.0)
    assert r.calibration == 4.0  # bounded


def test_calibration_is_the_90th_percentile_of_the_last_64_ratios():
    r = ServiceRates()
    for actual in [1.0] * 57 + [3.0] * 7:  # sorted, the 58th of 64 (index 57) is the first 3.0
        r.observe_wait(predicted_raw_s=2.0, actual_s=2.0 * actual)
    assert r.calibration == pytest.approx(3.0)
    assert r.mean_ratio == pytest.approx((57 * 1.0 + 7 * 3.0) / 64)  # what a long drain is priced at
    r.observe_wait(predicted_raw_s=2.0, actual_s=2.0)  # the oldest 1.0 leaves the window, a new one comes
    assert r.calibration == pytest.approx(3.0)
    for _ in range(64):  # the window slides: after 64 ratios of 1.5, only they are left
        r.observe_wait(predicted_raw_s=2.0, actual_s=3.0)
    assert r.calibration == pytest.approx(1.5)
    r.observe_wait(predicted_raw_s=0.01, actual_s=0.02)  # both under the noise floor: not calibrated on
    assert r.calibration == pytest.approx(1.5)


def test_turn_pace_is_measured_only_at_capacity():
    """The seconds per first token, measured while the engine is full: a long queue's pace."""
    model = WaitModel(max_num_seqs=2, aging_s=AGING_S)

    class Queue:  # what on_step reads of the scheduler
        def __init__(self, running: int, waiting: int):
            self.running, self.waiting = [object()] * running, [object()] * waiting

    model.on_first_token("x", now=0.0)  # a first token while the engine has room: not the queue's pace
    model.on_step(Queue(running=1, waiting=0), num_decodes=1, num_prefill_tokens=0, seconds=0.4)
    assert model.rates.turn_s is None
    for _ in range(10):  # full: a first token every second step of 0.2 s (requests waiting, then every slot taken)
        model.on_step(Queue(running=2, waiting=1), num_decodes=2, num_prefill_tokens=0, seconds=0.2)
        model.on_first_token("y", now=0.0)
        model.on_step(Queue(running=2, waiting=0), num_decodes=2, num_prefill_tokens=0, seconds=0.2)
    assert model.rates.turn_s == pytest.approx(0.4, rel=0.01)
    model.on_step(Queue(running=1, waiting=0), num_decodes=1, num_prefill_tokens=0, seconds=5.0)  # room again
    assert model.rates.turn_s == pytest.approx(0.4, rel=0.01)


def test_promises_count_ahead_in_the_share_that_clients_come_back():
    book = PromiseBook(grace_s=2.0)
    load = SeqLoad(100, 16)
    for k in range(4):  # due at 1, 2, 3, 4 s
        book.keep(k, Promise(due=float(k + 1), arrival=0.0, loads=(load,)))
    assert book.show_rate == 0.5
    assert len(book.ahead(now=0.0, horizon_s=3.0)) == 2  # three due within the horizon, half of them counted
    assert len(book.ahead(now=0.0, horizon_s=10.0)) == 2
    assert book.redeem(0).arrival == 0.0 and book.redeem(0) is None  # redeemed once
    assert book.kept == 1 and book.show_rate == pytest.approx(0.55)
    book.expire(now=4.5)  # due 2 s + 2 s grace has passed; due 3 s has not
    assert book.expired == 1 and len(book) == 2 and book.show_rate == pytest.approx(0.495)
    for k in range(10, 60):  # clients that never come back: their promises soon stop counting
        book.keep(k, Promise(due=5.0, arrival=0.0, loads=(load,)))
    book.expire(now=100.0)
    assert len(book) == 0 and book.show_rate < 0.01
    book.keep(99, Promise(due=101.0, arrival=0.0, loads=(load,)))
    assert book.ahead(now=100.0, horizon_s=5.0) == ()
    # the promised turns are a virtual queue: the drain estimate decides while it is later than the latest
    # standing turn plus this request's share of the engine, and never pulls a turn ahead of one promised before
    book = PromiseBook(grace_s=1.0)
    assert book.next_turn(now=100.0, drain_s=20.0, step_s=0.5) == 120.0  # nothing promised
    book.keep(1, Promise(due=120.0, arrival=100.0, loads=(load,), turn=120.0))
    assert book.next_turn(now=101.0, drain_s=12.0, step_s=0.5) == 120.5  # the estimate dipped: no crowd at 113
    book.keep(2, Promise(due=121.0, arrival=101.0, loads=(load,), turn=120.5))
    assert book.next_turn(now=102.0, drain_s=30.0, step_s=0.5) == 132.0  # it rose: later, never earlier
    book.redeem(1), book.redeem(2)  # both came back: nothing stands ahead of the next refusal but its drain
    assert book.next_turn(now=103.0, drain_s=2.0, step_s=0.5) == 105.0


# ---------------------------------------------------------------- the scheduler's order


def make_seq(prompt_len: int, priority: int = 0, arrival: float = 0.0, cached: int = 0) -> Sequence:
    return Sequence("r", 0, list(range(1, prompt_len + 1)), prompt_len, SamplingParams(), priority, arrival,
                    prompt_len + 8, num_cached_at_arrival=cached)


def first_admitted(*specs: dict) -> int:
    """Which of these sequences (make_seq's arguments) a one-slot scheduler runs first."""
    seqs = [make_seq(**spec) for spec in specs]
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=1, max_num_batched_tokens=512, aging_s=AGING_S)
    for s in seqs:
        sched.add(s)
    scheduled = sched.schedule()
    assert len(scheduled) == 1
    return seqs.index(scheduled[0].seq)


def test_priority_then_continuing_sessions_then_arrival_with_aging():
    now = time.perf_counter()
    cold = dict(prompt_len=40, arrival=now - 0.5)
    continuing = dict(prompt_len=40, arrival=now, cached=32)  # 32 of 40 prompt tokens were cached
    assert make_seq(**continuing).continuing and not make_seq(**cold).continuing
    assert first_admitted(cold, continuing) == 1  # a session's next turn overtakes a fresh first turn
    urgent = dict(prompt_len=40, priority=-1, arrival=now)
    assert first_admitted(continuing, urgent, cold) == 1  # explicit priority first (lower = sooner)
    aged = dict(prompt_len=40, arrival=now - 10 * AGING_S)  # waited long enough to go before any of them
    assert first_admitted(continuing, urgent, cold, aged) == 3
    assert first_admitted(cold, dict(prompt_len=40, arrival=now - 0.1)) == 0  # same class: first come first


def test_aging_means_no_cold_request_starves():
    """One slot serving a request per 0.5 s; a continuing turn arrives every 0.1 s, forever. The cold first
    turn that arrived at 0 is served once it has aged COLD_PENALTY levels, not never."""
    cold = (0, False, 0.0, 0)
    queue = [cold]
    served_at = None
    t, k = 0.0, 1
    while t < 60 and served_at is None:
        while k * 0.1 <= t:
            queue.append((0, True, k * 0.1, k))
            k += 1
        best = min(queue, key=lambda q: order_key(*q, now=t, aging_s=AGING_S))
        queue.remove(best)
        if best is cold:
            served_at = t
        t += 0.5
    assert served_at is not None and served_at <= COLD_PENALTY * AGING_S + 0.5


def test_greedy_output_is_exact_with_priorities_preemption_and_cached_sessions(tiny_model_dirs):
    """A pool so small that sequences are preempted and recomputed, requests of mixed priorities, half of
    them continuing a cached prompt: every greedy answer equals the same request run alone."""
    from sudu.engine.llm import LLM

    base = LLM(str(tiny_model_dirs["qwen2"]), progress=False)
    runner = base.engine.runner
    small = LLM(str(tiny_model_dirs["qwen2"]), progress=False, kv_cache_dtype=runner.config.kv_cache_dtype,
                kv_cache_memory=20 * 16 * runner.kv_bytes_per_token())
    g = random.Random(7)
    shared = [g.randrange(380) for _ in range(48)]
    prompts = [shared + [g.randrange(380) for _ in range(g.randrange(1, 20))] if i % 2 else
               [g.randrange(380) for _ in range(g.randrange(20, 90))] for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [base.generate([p], params)[0].token_ids for p in prompts]
    small.generate([shared + [1]], SamplingParams(max_tokens=1, temperature=0.0))  # the session's cached prefix
    together = small.generate(prompts, params, priorities=[i % 3 - 1 for i in range(8)])
    assert [r.token_ids for r in together] == alone
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks


# ---------------------------------------------------------------- the client's view


def test_predicted_wait_over_the_limit_is_429_with_retry_after(tiny_model_dirs):
    from sudu.config import EngineConfig
    from sudu.engine.async_engine import AsyncLLMEngine
    from sudu.server.app import build_app
    from tests.helpers.live_server import LiveServer, assert_openai_error

    config = EngineConfig(model=str(tiny_model_dirs["llama"]), max_model_len=256, max_num_seqs=2,
                          kv_cache_memory=8 << 20, max_queue_wait=1.0)
    engine = AsyncLLMEngine(config, progress=False)
    measured = engine.engine.wait_model.rates
    prompt = [5 + i for i in range(31)]  # 31 uncached tokens: nothing has run yet
    with LiveServer(build_app(engine)) as live:
        # measured at 0.1 s per prompt token, with one admitted 31-token prompt ahead (not sent on: it
        # stays "in transit"): 3.1 s behind it, over the 1 s limit, first token at 6.2 s; the queue ahead
        # drains in 3.1 s
        measured.prefill_s_per_token, measured.decode_step_s = 0.1, 0.01
        blocker = engine.check_request([300 + i for i in range(31)], SamplingParams(max_tokens=4))
        assert engine.try_admit("blocker", blocker).admitted  # alone: its own prompt is no reason to refuse
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        error = assert_openai_error(r, 429)
        assert error["type"] == "rate_limit_error" and error["code"] == "server_overloaded"
        assert "3.1 s" in error["message"] and "6.2 s" in error["message"]
        assert r.headers["retry-after"] == "4"
        # measured faster: 31 x 0.001 s, admitted and answered
        measured.prefill_s_per_token = 0.001
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        metrics = httpx.get(live.url + "/metrics").text
        assert "sudu:admission_refused_total 1.0" in metrics
        assert "sudu:admission_admitted_total 1.0" in metrics
        assert "sudu:admission_actual_wait_seconds_count 1.0" in metrics
        # an admitted request counts in the next prediction before the engine has it: 31-token prompts at
        # 0.02 s per token, the blocker still in transit; the second of two waits for three prompts
        # (1.86 s), 1.24 s of it behind the others: refused
        measured.prefill_s_per_token, measured.decode_step_s, measured.calibration = 0.02, 0.01, 1.0
        measured.mean_ratio = 1.0  # the drain a Retry-After is priced at: the model's, not what the run measured
        fresh = engine.check_request([100 + i for i in range(31)], SamplingParams(max_tokens=4))
        first = engine.try_admit("first", fresh)
        assert first.admitted and first.wait_s == pytest.approx(1.24)
        second = engine.try_admit("second", fresh)
        assert not second.admitted and second.wait_s == pytest.approx(1.86) and second.retry_after_s == 2
        # a later, different request is refused too...
        other = engine.check_request([200 + i for i in range(31)], SamplingParams(max_tokens=4))
        assert not engine.try_admit("third", other).admitted
        # ...and when the second comes back it is ahead of that later one: at 0.015 s per token it waits
        # 0.93 s behind two prompts (admitted), where the later one waits behind three
        measured.prefill_s_per_token = 0.015
        assert engine.try_admit("second-again", fresh).admitted
        # the later one comes back: before the engine has run at capacity it is judged like any arrival (from
        # its first arrival): 1.395 s, over the 1 s limit, refused again...
        again = engine.try_admit("third-again", other)
        assert not again.admitted and again.queue_s == pytest.approx(1.395)
        # ...once the pace at capacity is measured, a returning client is judged by it, its first token within
        # 1.4x the limit: three requests not yet started ahead of it (the blocker, first, second-again, all in
        # transit), then its own 31 tokens (0.465 s); at 0.6 s per first token that is 2.265 s, refused; at
        # 0.3 s, 1.365 s: admitted
        measured.turn_s = 0.6
        assert not engine.try_admit("third-later", other).admitted
        measured.turn_s = 0.3
        last = engine.try_admit("third-last", other)
        assert last.admitted and last.queue_s == pytest.approx(0.9)
        assert engine.stats()["admission_promised"] == 0


def test_prompts_beside_decoders_are_predicted_at_the_chunk_allowance():
    """With --max-itl-factor 2, a step carrying prompt chunks takes two decode steps, half of it the prompt's:
    prompt tokens beside decoding sequences cost twice their rate alone, decode steps twice theirs."""
    rates = WaitModel(max_num_seqs=2, aging_s=AGING_S, itl_factor=2.0).rates
    rates.prefill_s_per_token, rates.decode_step_s, rates.output_tokens = 0.01, 0.1, 10.0
    alone = raw_wait_s(EngineLoad(), SeqLoad(100, 16), 2, rates, now=0.0, aging_s=AGING_S)
    assert alone[:2] == (pytest.approx(1.0), pytest.approx(1.0))  # nothing decodes: the prompt at full rate
    # one running sequence decoding 10 more tokens: the new prompt's 100 tokens at 0.02 s (2.0 s) in the free
    # slot; the serial bound is the same 100 tokens
    beside = raw_wait_s(EngineLoad(running=(SeqLoad(0, 10),)), SeqLoad(100, 16), 2, rates, now=0.0, aging_s=AGING_S)
    assert beside[:2] == (pytest.approx(2.0), pytest.approx(2.0))
    # both slots taken: the new one starts when the first frees, after its 10 tokens at 0.2 s a step (2.0 s)
    full = EngineLoad(running=(SeqLoad(0, 10), SeqLoad(0, 30)))
    assert raw_wait_s(full, SeqLoad(100, 16), 2, rates, now=0.0, aging_s=AGING_S)[0] == pytest.approx(2.0 + 2.0)


def test_promises_neither_idle_the_engine_nor_shorten_a_retry(tiny_model_dirs):
    """Promised work counts ahead of a new arrival, but a request that would start at once on the engine's
    real queue is admitted anyway; and a refusal's Retry-After is its turn after every earlier promise's, due
    soon or not (a virtual queue, spaced by each request's share of the engine), where admission counts only
    the promises due within the limit."""
    import time

    from sudu.config import EngineConfig
    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["llama"]), max_model_len=1024, max_num_seqs=4,
                          kv_cache_memory=8 << 20, max_queue_wait=1.0)
    engine = AsyncLLMEngine(config, progress=False)
    rates = engine.engine.wait_model.rates
    rates.prefill_s_per_token, rates.decode_step_s = 0.01, 0.001
    book = engine._promises
    book.show_rate = 1.0  # clients that always come back: every promise counts
    now = time.perf_counter()
    book.keep(1, Promise(due=now + 0.5, arrival=now - 1.0, loads=(SeqLoad(200, 4, arrival_time=now - 1.0),),
                         turn=now + 0.5))
    book.keep(2, Promise(due=now + 5.0, arrival=now - 1.0, loads=(SeqLoad(500, 4, arrival_time=now - 1.0),),
                         turn=now + 5.0))

    def request(first: int):
        return engine.check_request([first + i for i in range(31)], SamplingParams(max_tokens=4))

    # nothing runs or waits: the 200 promised tokens due in 0.5 s would make a 2 s queue, but refusing would
    # only idle the engine
    assert engine.try_admit("a", request(100)).admitted
    # now a prompt is in transit ahead: 2.31 s behind the promise due soon and it, refused; told to come back
    # at its turn after the far promise's (5.0 s), by its own share of the engine: before the engine has run
    # at capacity, the model's cost of one more like it (31 tokens at 0.01 s): ceil(5.31) = 6 s
    refused = engine.try_admit("b", request(200))
    assert not refused.admitted and refused.queue_s == pytest.approx(2.31)
    assert refused.retry_after_s == 6
    # measured at capacity, the engine starts a request every 0.765 s: each later refusal's turn comes that
    # pace / PROMISED_UTILIZATION (0.9 s) after the one before, however short its own queue: 5.31 + 0.9 = 6.21
    # s, then 7.11 s
    rates.turn_s = 0.765
    assert engine.try_admit("d", request(250)).retry_after_s == 7
    assert engine.try_admit("c", request(300)).retry_after_s == 8
