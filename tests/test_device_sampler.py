"""The device sampler (layers/device_sampler.py) against the CPU sampler's semantics: the same greedy picks,
the same token sets kept by penalties and filters, draws distributed as the filtered softmax, seeded tokens
independent of the batch, the same logprobs; and an engine sampling with it behaves as documented."""
import random

import pytest
import torch

from sudu.engine.llm import LLM
from sudu.layers.device_sampler import DeviceSampler, keep_mask, mix32, uniforms
from sudu.layers.sampler import Sampler, SamplingRow, apply_penalties, filter_logits
from sudu.sampling import SamplingParams


def row(prompt=(), output=(), seed=None, **params):
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), None, seed)


def random_params(g: random.Random, vocab: int) -> dict:
    p = dict(temperature=g.choice([0.3, 0.7, 1.0, 1.6]))
    if g.random() < 0.5:
        p["top_k"] = g.choice([1, 2, 5, 40, vocab - 1, vocab, vocab + 3])
    if g.random() < 0.5:
        p["top_p"] = g.choice([0.05, 0.5, 0.9, 0.99])
    if g.random() < 0.4:
        p["min_p"] = g.choice([0.01, 0.1, 0.5])
    if g.random() < 0.4:
        p["repetition_penalty"] = g.choice([0.8, 1.3])
    if g.random() < 0.4:
        p["frequency_penalty"] = g.choice([-0.5, 0.7])
    if g.random() < 0.4:
        p["presence_penalty"] = g.choice([-1.0, 0.4])
    return p


def test_hash_is_lowbias32_in_exact_integer_arithmetic():
    """The int64 tensor hash equals the 32-bit hash computed on Python's unbounded ints, at the extremes too:
    no intermediate overflowed, so any device computing int64 exactly gets the same bits."""
    def reference(x):
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0xD35A2D97) & 0xFFFFFFFF
        return x ^ (x >> 15)

    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
    values += random.Random(0).sample(range(1 << 32), 2000)
    assert mix32(torch.tensor(values)).tolist() == [reference(v) for v in values]
    u = uniforms(torch.tensor([0, 1, -1, (1 << 63) - 1]), torch.tensor([0, 5, 0xFFFFFFFF, 7]), 4096)
    assert u.dtype == torch.float32 and float(u.min()) > 0.0 and float(u.max()) < 1.0


def test_greedy_equals_the_cpu_sampler_with_ties_nans_and_penalties():
    torch.manual_seed(0)
    logits = torch.randn(12, 64).round()  # integer logits: many ties for the top
    logits[3, 10] = float("nan")
    logits[4] = 2.0
    logits[5, :] = float("-inf")
    logits[5, 17] = 0.0
    rows = [row(temperature=0) for _ in range(6)]
    rows += [row([1, 2, 3], [3, 9], temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                 presence_penalty=0.2) for _ in range(3)]
    rows += [row(temperature=0.8, seed=1), row([5], [5, 5], temperature=0, frequency_penalty=2.0),
             row(temperature=0, logprobs=2)]
    ours = [t.token_id for t in DeviceSampler()(logits, rows)]
    theirs = [t.token_id for t in Sampler()(logits, rows)]
    assert [t for i, t in enumerate(ours) if i != 9] == [t for i, t in enumerate(theirs) if i != 9]
    assert ours[3] == 10 and ours[4] == 0 and ours[5] == 17


@pytest.mark.parametrize("ties", [False, True])
def test_kept_tokens_equal_the_cpu_filters(ties):
    """For random logits (with grammar-masked entries) and parameter mixes, the tokens a row can be drawn
    from are exactly those sampler.py's apply_penalties + filter_logits keep. With ties (logits on a coarse
    grid) top-p is left out: which of two equal tokens crosses its line is the sort's choice on both sides."""
    g = random.Random(1 + ties)
    vocab = 96
    for trial in range(40):
        torch.manual_seed(trial)
        n = g.randint(1, 8)
        logits = torch.randn(n, vocab) * g.choice([1.0, 3.0, 8.0])
        if ties:
            logits = (logits * 2).round() / 2
        logits[torch.rand(n, vocab) < 0.1] = float("-inf")
        rows = []
        for _ in range(n):
            params = random_params(g, vocab)
            if ties:
                params.pop("top_p", None)
            rows.append(row([g.randrange(vocab) for _ in range(g.randint(0, 6))],
                            [g.randrange(vocab) for _ in range(g.randint(0, 10))], **params))
        expected = torch.stack([filter_logits(apply_penalties(logits[i].clone(), r), r.params) > float("-inf")
                                for i, r in enumerate(rows)])
        assert torch.equal(keep_mask(logits, rows), expected), trial


def test_keep_mask_covers_only_sampled_rows_in_batch_order():
    logits = torch.randn(3, 20)
    rows = [row(temperature=0.5, top_k=3), row(temperature=0), row(temperature=1.0, top_k=1)]
    mask = keep_mask(logits, rows)
    assert mask.shape == (2, 20) and mask.sum(-1).tolist() == [3, 1]
    assert mask[1].nonzero().item() == int(logits[2].argmax())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the tokens probs gives mass; inf when a token outside them was drawn."""
    n = counts.sum()
    support = probs > 0
    if (counts[~support] > 0).any():
        return float("inf")
    expected = probs[support] * n
    return float(((counts[support] - expected) ** 2 / expected).sum())


def test_draws_follow_the_filtered_softmax():
    """20000 draws (100 seeds x 200 draw indices) of one row over 8 tokens: Pearson's chi-square against the
    filtered softmax stays under its 99.99% quantile (df <= 5: 25.7), while the distributions of a 10%
    different temperature or a top-p one token wider are rejected by the same draws."""
    logits = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.4, 0.0, -0.5, -1.0])
    params = dict(temperature=0.8, top_k=7, top_p=0.9)
    outputs = [[0] * d for d in range(200)]  # draw index = the number of output tokens
    rows = [row(output=out, seed=s, **params) for s in range(100) for out in outputs]
    tokens = torch.tensor([t.token_id for t in DeviceSampler()(logits.expand(len(rows), -1), rows)])
    counts = torch.bincount(tokens, minlength=8).double()

    def probs(**p):
        return filter_logits(logits.clone(), SamplingParams(**p)).softmax(-1).double()

    target = probs(**params)
    assert int((target > 0).sum()) == 5
    assert chi_square(counts, target) < 25.7
    assert chi_square(counts, probs(temperature=0.88, top_k=7, top_p=0.9)) > 25.7
    wider = filter_logits(logits.clone() / 0.8, SamplingParams(temperature=1.0, top_k=6))  # 6 tokens kept
    assert chi_square(counts, wider.softmax(-1).double()) > 25.7


def test_seeded_token_ignores_batch_companions_and_row_order():
    g = random.Random(3)
    torch.manual_seed(3)
    vocab = 50
    target_logits = torch.randn(vocab)
    target = row([1, 2], [4, 4, 9], seed=1234, temperature=1.1, top_p=0.95, repetition_penalty=1.2)
    sampler = DeviceSampler()
    alone = sampler(target_logits[None], [target])[0].token_id
    for trial in range(10):
        others = [row([g.randrange(vocab)], [g.randrange(vocab) for _ in range(g.randint(0, 5))],
                      seed=g.choice([None, trial]), **random_params(g, vocab)) for _ in range(g.randint(1, 6))]
        at = g.randint(0, len(others))
        rows = others[:at] + [target] + others[at:]
        logits = torch.randn(len(rows), vocab)
        logits[at] = target_logits
        assert sampler(logits, rows)[at].token_id == alone
    assert DeviceSampler(seed=99)(target_logits[None], [target])[0].token_id == alone

    def sequence(seed):
        return [sampler(target_logits[None], [row(output=[0] * d, seed=seed, temperature=1.5)])[0].token_id
                for d in range(24)]

    assert sequence(7) == sequence(7)
    assert sequence(7) != sequence(8)
    assert len(set(sequence(7))) > 3  # the draw index moves the draws


def test_logprobs_and_alternatives_equal_the_cpu_sampler():
    torch.manual_seed(4)
    logits = torch.randn(5, 40) * 3
    rows = [row(temperature=0, logprobs=3), row(temperature=0.9, seed=2, logprobs=5), row(temperature=0),
            row([1], [2, 2], temperature=0, repetition_penalty=1.5, logprobs=0),
            row(temperature=0.7, top_k=4, seed=5, logprobs=1)]
    ours, theirs = DeviceSampler()(logits, rows), Sampler()(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert (a.logprob is None) == (b.logprob is None)
        if a.logprob is not None:
            assert a.logprob == pytest.approx(float(raw[i, a.token_id]), abs=1e-6)
        assert (a.top is None) == (b.top is None)
        if a.top is not None:
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-6)
    assert [ours[i].token_id for i in (0, 2, 3)] == [theirs[i].token_id for i in (0, 2, 3)]


def test_a_masked_row_returns_its_one_allowed_token():
    """Structured output sets disallowed logits to -inf before sampling: whatever the parameters, a row that
    allows one token gets it, and a row that allows three gets one of them."""
    g = random.Random(5)
    vocab = 300
    for trial in range(20):
        n = 6
        logits = torch.full((n, vocab), float("-inf"))
        allowed = [[g.randrange(vocab)] if i % 2 == 0 else g.sample(range(vocab), 3) for i in range(n)]
        for i, ids in enumerate(allowed):
            logits[i, ids] = torch.randn(len(ids)) * 5
        rows = [row([g.randrange(vocab)], [g.randrange(vocab) for _ in range(3)], seed=g.choice([None, trial]),
                    **random_params(g, vocab)) for _ in range(n)]
        for ids, tok in zip(allowed, DeviceSampler(trial)(logits, rows)):
            assert tok.token_id in ids


@pytest.mark.parametrize("sampler", [Sampler, DeviceSampler])
def test_a_temperature_past_float32s_range_draws_uniformly_from_the_allowed_tokens(sampler):
    """A temperature that float32 holds only as inf would make a masked (-inf) logit NaN: both samplers
    cap it (sampling.py MAX_SCALED_TEMPERATURE) and draw uniformly among the tokens not masked."""
    logits = torch.randn(1, 50) * 4
    logits[0, 10:] = float("-inf")
    counts = torch.zeros(50)
    draw = sampler(0)
    for seed in range(400):
        counts[draw(logits, [row([1], [], seed=seed, temperature=1.8e89, min_p=0.5)])[0].token_id] += 1
    assert counts[10:].sum() == 0
    assert counts[:10].min() >= 15  # uniform: 40 each expected


def test_a_sampled_row_that_allows_no_token_raises():
    """As the CPU sampler's multinomial does: the engine then samples row by row and fails that request alone."""
    logits = torch.randn(2, 50)
    logits[1] = float("-inf")
    with pytest.raises(ValueError, match="no token can be sampled"):
        DeviceSampler(0)(logits, [row([1], [], temperature=0.8), row([1], [], temperature=0.8)])


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    default = LLM(str(tiny_model_dirs["qwen2"]), progress=False)
    device = LLM(str(tiny_model_dirs["qwen2"]), progress=False)
    device.engine.sampler = DeviceSampler(device.engine.config.seed)
    return default, device


def test_engine_with_the_device_sampler(engines):
    default, device = engines
    assert isinstance(default.engine.sampler, Sampler)  # the CPU engine keeps the CPU sampler
    g = random.Random(6)
    prompts = [[g.randrange(380) for _ in range(n)] for n in (3, 11, 20, 7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert ([r.token_ids for r in device.generate(prompts, greedy)]
            == [r.token_ids for r in default.generate(prompts, greedy)])

    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=1234,
                            max_tokens=16, ignore_eos=True)
    alone = device.generate([prompts[1]], seeded)[0].token_ids
    assert device.generate([prompts[1]], seeded)[0].token_ids == alone
    others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), greedy,
              SamplingParams(temperature=0.7, seed=5, max_tokens=12, ignore_eos=True)]
    mixed = device.generate([prompts[0], prompts[1], prompts[2], prompts[3]],
                            [others[0], seeded, others[1], others[2]])
    assert mixed[1].token_ids == alone
    assert device.generate([prompts[1]], SamplingParams(temperature=0.9, top_p=0.95, top_k=50,
                                                        repetition_penalty=1.1, seed=99, max_tokens=16,
                                                        ignore_eos=True))[0].token_ids != alone
