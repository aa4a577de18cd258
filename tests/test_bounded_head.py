"""The bounded head (layers/bounded_head.py, kernels/bounded_head.cpp): greedy rows' logits from a 4-bit
shadow of an 8-bit head. Where it serves, its argmax is the whole head's (ties included) and every finite
logit is the whole head's bit for bit; it runs only for steps of a few rows that want nothing but the
argmax; the engine's greedy tokens are the same with it and without it."""
import contextlib
import math

import pytest
import torch

from sudu import kernels
from sudu.engine.llm import LLM
from sudu.layers import bounded_head as B
from sudu.layers import gguf_native
from sudu.layers import linear as L
from sudu.quant.formats import TILE_ROWS
from sudu.sampling import SamplingParams
from tests.helpers.native_blocks import isas, on_isa, random_tensor

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"no native kernels: {kernels.disabled_reason() or 'compile failed'}")

V, K = 2048, 256


@pytest.fixture
def restore_isa():
    """Runs the rest of a test on a kernel path by name; the CPU's best path is restored after it."""
    with contextlib.ExitStack() as stack:
        yield lambda name: stack.enter_context(on_isa(name))


def head(kind: str, seed: int = 0) -> L.QuantizedLinear:
    """An output head [V, K]: sudu's int8 tiles, or a GGUF type's own blocks."""
    if kind == "int8":
        g = torch.Generator().manual_seed(seed)
        return L.QuantizedLinear.from_float("int8", torch.randn(V, K, generator=g) * 0.05)
    return gguf_native.native_layer(random_tensor(kind, V, K, seed=seed), None)


def hidden(n: int, seed: int, rank: int = 6, noise: float = 0.05) -> torch.Tensor:
    """Rows like final hidden states: most of their length in a few directions (the same ones for every
    seed), the rest spread."""
    basis = torch.randn(rank, K, generator=torch.Generator().manual_seed(99)) * 3.0
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, rank, generator=g) @ basis + noise * torch.randn(n, K, generator=g)).contiguous()


def check_rows(bounded: B.BoundedHead, h: L.QuantizedLinear, x: torch.Tensor) -> bool:
    """Whether bounded served x; asserts what it gave against the whole head."""
    got = bounded.logits(x)
    if got is None:
        return False
    want = h(x)
    assert torch.equal(got.argmax(1), want.argmax(1))
    finite = torch.isfinite(got)
    assert finite.any(1).all()
    assert torch.equal(got[finite], want[finite])  # the head's own values, bit for bit
    return True


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("kind", ["int8", "Q8_0", "Q6_K"])
def test_argmax_and_values_are_the_whole_heads(kind, isa, restore_isa):
    restore_isa(isa)
    h = head(kind)
    bounded = B.BoundedHead(h, hidden(256, seed=1))
    served = 0
    for seed in range(40):
        for rows in (1, 3):
            served += check_rows(bounded, h, hidden(rows, seed=1000 + seed))
    assert served >= 60  # the bound is tight enough here to serve most calls
    tiles = -(-V // TILE_ROWS)
    assert bounded.tiles_read / max(1, bounded.calls - bounded.whole_head) < tiles / 4


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("kind", ["int8", "Q6_K"])
def test_qlinear_tiles_are_qlinears_columns(kind, isa, restore_isa):
    restore_isa(isa)
    h = head(kind)
    g = torch.Generator().manual_seed(7)
    picks = [torch.tensor([0]), torch.tensor([3, 4, 5, 90, 127]), torch.arange(128),
             torch.randperm(128, generator=g)[:40].sort().values]
    for rows in (1, 3, 9):
        x = torch.randn(rows, K, generator=g)
        whole = ext.qlinear(x, h.qweight, None)
        for idx in picks:
            cols = (idx[:, None] * TILE_ROWS + torch.arange(TILE_ROWS)).reshape(-1)
            assert torch.equal(ext.qlinear_tiles(x, h.qweight, idx), whole[:, cols])
    for bad in (torch.tensor([5, 3]), torch.tensor([128]), torch.tensor([-1])):
        with pytest.raises(RuntimeError, match="ascend"):
            ext.qlinear_tiles(x, h.qweight, bad)


def test_ties_resolve_as_the_whole_head():
    """Two vocabulary rows (in different tiles) with the same weights and the largest logit: both tie, and
    the first wins, as torch.argmax and the whole head give."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(V, K, generator=g) * 0.05
    x = hidden(8, seed=5)
    top = x[0] / x[0].norm() * 0.5
    w[37], w[1500] = top, top
    h = L.QuantizedLinear.from_float("int8", w)
    bounded = B.BoundedHead(h, hidden(256, seed=1))
    got = bounded.logits(x[:1])
    assert got is not None and h(x[:1])[0, 37] == h(x[:1])[0, 1500]
    assert int(got.argmax()) == int(h(x[:1]).argmax()) == 37
    assert got[0, 1500] == got[0, 37]


def test_loose_bounds_and_bad_rows_run_the_whole_head():
    h = head("int8")
    bounded = B.BoundedHead(h, hidden(256, seed=1))
    x = torch.randn(1, K)  # far from the calibration directions: a loose bound
    bounded.max_tiles = 1
    assert bounded.logits(x) is None and bounded.whole_head == 1
    bounded.max_tiles = 10 ** 6
    assert bounded.logits(torch.full((1, K), math.nan)) is None
    assert check_rows(bounded, h, x)  # with room for every tile it serves, and is right


class Seq:
    def __init__(self, params):
        self.params = params


class Scheduled:
    def __init__(self, params, rows=1):
        self.seq, self.num_logit_rows = Seq(params), rows


def test_serves_only_argmax_steps_of_few_rows():
    greedy = SamplingParams(temperature=0.0)
    assert B.serves([Scheduled(greedy), Scheduled(greedy, rows=3)])
    assert not B.serves([Scheduled(greedy, rows=B.MAX_ROWS + 1)])
    assert B.serves([Scheduled(greedy, rows=B.MAX_ROWS), Scheduled(SamplingParams(temperature=0.7), rows=0)])
    for other in (dict(temperature=0.7), dict(temperature=0.0, logprobs=2), dict(temperature=0.0, presence_penalty=0.5),
                  dict(temperature=0.0, frequency_penalty=0.1), dict(temperature=0.0, repetition_penalty=1.1),
                  dict(temperature=0.0, grammar='start: "a"')):
        assert not B.serves([Scheduled(greedy), Scheduled(SamplingParams(**other))]), other


def test_eligible_heads():
    class Model(torch.nn.Module):
        PLAIN_HEAD = True

        def __init__(self, lm_head):
            super().__init__()
            self.lm_head = lm_head

    saved = B.MIN_VOCAB
    B.MIN_VOCAB = 1024
    try:
        assert B.eligible(Model(head("int8"))) and B.eligible(Model(head("Q8_0")))
        w = torch.randn(V, K) * 0.05
        assert not B.eligible(Model(L.QuantizedLinear.from_float("int4", w)))  # too little to save
        assert not B.eligible(Model(head("Q6_K"))) and not B.eligible(Model(head("Q5_0")))
        assert not B.eligible(Model(L.QuantizedLinear.from_float("int8", w, torch.randn(V))))  # a bias
        plain = Model(head("int8"))
        plain.PLAIN_HEAD = False  # logits that are more than the head's outputs
        assert not B.eligible(plain)
    finally:
        B.MIN_VOCAB = saved


def test_engine_tokens_are_the_same(tiny_model_dirs, monkeypatch):
    """The tiny model's vocabulary is below MIN_VOCAB and its bound loose: both lifted, so every greedy step
    of a few rows takes the bounded head."""
    monkeypatch.setattr(B, "MIN_VOCAB", 0)
    monkeypatch.setattr(B, "MAX_TILE_FRACTION", 1.0)
    path = str(tiny_model_dirs["qwen2"])
    kw = dict(quantization="int8", progress=False, speculative="none", kv_cache_memory=16 << 20)
    bounded, whole = LLM(path, **kw), LLM(path, greedy_head="full", **kw)
    assert bounded.engine.runner.bounded_head is not None and whole.engine.runner.bounded_head is None
    prompts = ["def add(a, b):", "The quick brown fox", "SELECT name"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in bounded.generate(prompts, greedy)]
    assert got == [o.outputs[0].token_ids for o in whole.generate(prompts, greedy)]
    stats = bounded.engine.runner.bounded_head
    assert stats.calls - stats.whole_head >= 20  # single-sequence steps of the three prompts' decode
    calls = stats.calls
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=1)
    assert ([o.outputs[0].token_ids for o in bounded.generate(prompts, sampled)]
            == [o.outputs[0].token_ids for o in whole.generate(prompts, sampled)])
    assert stats.calls == calls  # sampled rows read the whole head
