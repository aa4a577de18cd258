"""The cost-aware draft length (engine/spec/cost.py): a free drafter's tokens are verified only where
they pay for their rows, from the measured row cost and each sequence's measured acceptance."""
import pytest

from sudu.engine.spec import cost as draft_cost
from sudu.engine.spec.cost import Acceptance, StepCost, keep_lengths
from sudu.sampling import SamplingParams
from tests.helpers.speculative import GREEDY, engines, draft_dir, prompts  # noqa: F401 -- fixtures


def test_step_cost_fits_the_row_cost_and_refuses_alike_rows():
    cost = StepCost(retention=1.0)
    for _ in range(10):
        cost.observe(8, 0.040 + 8 * 0.002)
    assert cost.fit() is None  # every step had 8 rows: a row's cost cannot be told from the step's
    for rows in (8, 12, 20, 30, 9, 16):
        cost.observe(rows, 0.040 + rows * 0.002)
    a, b = cost.fit()
    assert a == pytest.approx(0.040) and b == pytest.approx(0.002)
    fresh = StepCost()
    for rows in (1, 8, 3):
        fresh.observe(rows, 0.02)
    assert fresh.fit() is None  # too few steps


def test_step_cost_follows_the_batch_as_it_changes():
    cost = StepCost(retention=0.8)
    for i in range(40):
        rows = 1 + i % 7
        cost.observe(rows, 0.020 + rows * 0.0005)  # one stream: rows nearly free
    for i in range(40):
        rows = 8 + i % 20
        cost.observe(rows, 0.030 + rows * 0.004)  # eight streams: compute-bound, rows cost
    assert cost.fit()[1] == pytest.approx(0.004, rel=0.05)


def test_keep_lengths_weighs_each_token_against_the_rate_of_the_step():
    offered = [7, 7]
    assert keep_lengths(offered, [0.5, 0.5], None, 8, 8) == offered  # not measured yet: verify them all
    assert keep_lengths(offered, [0.5, 0.5], (0.02, 0.0), 2, 2, payback=1.0) == offered  # free rows: all
    # one stream, 20 ms steps, 1 ms a row: token i pays while 0.5 ** i * step s >= 1 ms * tokens (both
    # updated as tokens are added): 0.5 (10 >= 1), 0.25 (5.25 >= 1.5), 0.125 (2.75 >= 1.75) pay,
    # 0.0625 (1.44 < 1.875) does not
    assert keep_lengths([7], [0.5], (0.019, 0.001), 1, 1, payback=1.0) == [3]
    # eight streams, rows dear: only the sequence that accepts well drafts, and only its likeliest tokens
    kept = keep_lengths([7] * 8, [0.9] + [0.2] * 7, (0.030, 0.004), 8, 8, payback=1.0)
    assert kept[0] > 0 and kept[1:] == [0] * 7
    assert keep_lengths([7] * 8, [0.2] * 8, (0.030, 0.004), 8, 8, payback=1.0) == [0] * 8  # plain decoding
    # the likeliest offers across the batch go first: 0.95, 0.90, 0.86, then 0.6 pay; 0.36 does not
    assert keep_lengths([3, 3], [0.95, 0.6], (0.030, 0.006), 2, 2, payback=1.0) == [3, 1]
    # the default asks a token for twice its cost: four streams, 20 ms + 2 ms a row, the first token pays
    # at 0.29 acceptance; 0.45 clears that but not 0.57, copying (0.95) clears both
    assert keep_lengths([7] * 4, [0.45] * 4, (0.020, 0.002), 4, 4, payback=1.0)[0] > 0
    assert keep_lengths([7] * 4, [0.45] * 4, (0.020, 0.002), 4, 4) == [0] * 4
    assert all(k > 0 for k in keep_lengths([7] * 4, [0.95] * 4, (0.020, 0.002), 4, 4))


def test_acceptance_is_per_sequence_with_the_engine_rate_as_prior():
    acc = Acceptance()
    assert acc.rate(1) == pytest.approx(0.5)  # nothing seen
    for _ in range(20):
        acc.update(1, 7, 7)  # copying: every token accepted
        acc.update(2, 3, 0)  # writing: none
    assert acc.rate(1) > 0.9 and acc.rate(2) < 0.2
    assert acc.rate(3) == pytest.approx((140 + 1) / (140 + 20 + 2))  # a new sequence starts at the engine's rate
    acc.release(1)
    assert acc.rate(1) == acc.rate(3)


@pytest.mark.parametrize("row_cost,drafts", [(0.0, True), (10.0, False)])
def test_the_engine_drafts_only_what_pays(engines, monkeypatch, row_cost, drafts):
    """A measured row cost the drafts cannot repay (10 s a row) turns n-gram drafting off; free rows keep
    it on. The output is plain decoding's either way."""
    ps = prompts(8, seed=11)
    params = SamplingParams(max_tokens=16, **GREEDY)
    plain = [r.token_ids for r in engines().generate(ps, params)]
    llm = engines("ngram", speculative_max_batch=64)
    spec = llm.engine.speculator
    assert spec.cost_aware
    monkeypatch.setattr(spec.step_cost, "fit", lambda: (0.02, row_cost))
    before = spec.num_draft_tokens
    assert [r.token_ids for r in llm.generate(ps, params)] == plain
    assert (spec.num_draft_tokens > before) == drafts


def test_draft_model_keeps_the_adaptive_length(engines):
    """A drafter that pays per proposed token is not cut by the row rule (its own cost is not measured
    there)."""
    assert not engines("draft", speculative_max_batch=64).engine.speculator.cost_aware
    assert draft_cost.StepCost.MIN_STEPS > 0
