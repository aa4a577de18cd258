"""Speculative decoding is lossless: greedy output identical to plain decoding for both drafters at
batch 1 and 8; sampled output keeps the target distribution (chi-square over >= 10,000 samples);
rollback returns every block."""
import random

import pytest
import torch

from sudu.engine.llm import LLM
from sudu.engine.spec.ngram import NgramDrafter
from sudu.engine.spec.verify import Draft, verify_draft
from sudu.engine.sequence import Sequence
from sudu.errors import SuduError
from sudu.layers.sampler import SamplingRow
from sudu.sampling import SamplingParams
from tests.helpers.greedy import GREEDY
from tests.helpers.speculative import (  # noqa: F401 -- draft_dir and engines are fixtures
    assert_second_token_keeps_the_target_distribution, chi2_critical, chi2_stat, draft_dir, engines, prompts)


@pytest.mark.parametrize("spec,batch,draft_vocab", [
    ("ngram", 1, 0), ("ngram", 8, 0), ("draft", 1, 0), ("draft", 8, 0), ("self", 8, 0),
    ("draft", 8, 200),  # the draft head limited to ids < 200 (+ specials): the target still decides
])
def test_greedy_identical_with_speculation(engines, spec, batch, draft_vocab):
    ps = prompts(50, seed=batch)
    params = SamplingParams(max_tokens=16, **GREEDY)
    plain = [r.token_ids for r in engines().generate(ps, params)]
    llm = engines(spec, speculative_max_batch=64, speculative_draft_vocab=draft_vocab)
    got = []
    for i in range(0, len(ps), batch):
        got += [r.token_ids for r in llm.generate(ps[i:i + batch], params)]
    assert got == plain
    eng = llm.engine
    assert eng.speculator.num_draft_tokens > 0  # speculation really ran
    if spec == "self":
        assert eng.speculator.num_accepted_tokens == eng.speculator.num_draft_tokens  # a model agrees with itself
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_quantized_draft_model_drafts_through_an_int4_head(engines):
    """With quantized weights the draft's head runs int4 (DRAFT_HEAD_FORMAT) while the target keeps its own
    format; the output stays exactly plain decoding's."""
    from sudu.layers.linear import QuantizedLinear

    llm = engines("draft", quantization="int8", speculative_max_batch=64)
    head = llm.engine.speculator.drafter.runner.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.fmt == "int4"
    assert llm.engine.runner.model.lm_head.fmt == "int8"
    ps = prompts(16, seed=41)
    params = SamplingParams(max_tokens=16, **GREEDY)
    plain = [r.token_ids for r in engines(quantization="int8").generate(ps, params)]
    assert [r.token_ids for r in llm.generate(ps, params)] == plain
    assert llm.engine.speculator.num_draft_tokens > 0


def test_acceptance_is_reported_per_request(engines):
    llm = engines("ngram", speculative_max_batch=64)
    r = llm.generate([prompts(1, 3)[0]], SamplingParams(max_tokens=30, **GREEDY))[0]
    m = r.metrics
    assert m.num_spec_steps > 0 and m.num_draft_tokens > 0
    assert 0.0 <= m.acceptance_rate <= 1.0
    assert 1.0 <= m.mean_accepted_len <= 1 + llm.engine.speculator.controller.max_tokens


def test_draft_length_defaults_per_drafter():
    """num_speculative_tokens = 0 (the default) takes the drafter's measured default; a setting wins."""
    from sudu.config import EngineConfig
    from sudu.engine.spec.controller import DEFAULT_DRAFT_LEN, draft_len

    assert draft_len(EngineConfig(speculative="ngram")) == DEFAULT_DRAFT_LEN["ngram"] == 7
    assert draft_len(EngineConfig(speculative="draft:qwen2.5-coder-0.5b-instruct")) == DEFAULT_DRAFT_LEN["draft"] == 4
    assert draft_len(EngineConfig(speculative="ngram", num_speculative_tokens=3)) == 3


def test_speculation_pauses_above_max_batch(engines):
    llm = engines("ngram", speculative_max_batch=2)
    before = llm.engine.speculator.num_draft_tokens
    llm.generate(prompts(8, 4), SamplingParams(max_tokens=4, **GREEDY))
    assert llm.engine.speculator.num_draft_tokens == before  # 8 decoding > 2: never speculated


def test_the_default_drafts_n_gram_for_greedy_requests_on_the_cpu_kernels(tiny_model_dirs, engines):
    """--speculative auto (the default): n-gram lookup on the CPU kernels' weight formats, paused above 4
    decoding sequences, for greedy requests only (a seeded sampled request draws as it does without
    speculation); float weights and CUDA get none; explicit settings stand."""
    from sudu.config import EngineConfig
    from sudu.engine.spec.controller import resolve_drafter as resolve

    auto, cpu = EngineConfig(), torch.device("cpu")
    assert auto.speculative == "auto"
    assert [resolve(auto, cpu, f) for f in ("native", "int8", "int4", "none")] == ["ngram"] * 3 + ["none"]
    assert resolve(auto, torch.device("cuda"), "none") == "none"
    assert resolve(EngineConfig(speculative="none"), cpu, "int4") == "none"
    assert resolve(EngineConfig(speculative="ngram"), cpu, "none") == "ngram"

    llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, quantization="int8")
    spec = llm.engine.speculator
    assert spec is not None and spec.greedy_only and spec.controller.max_batch == 4
    plain = engines("none", quantization="int8")
    ps = prompts(3, 9)
    greedy = SamplingParams(max_tokens=24, **GREEDY)
    before = spec.num_draft_tokens
    assert [r.token_ids for r in llm.generate(ps, greedy)] == [r.token_ids for r in plain.generate(ps, greedy)]
    assert spec.num_draft_tokens > before
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    before = spec.num_draft_tokens
    assert [r.token_ids for r in llm.generate(ps, sampled)] == [r.token_ids for r in plain.generate(ps, sampled)]
    assert spec.num_draft_tokens == before
    assert LLM(str(tiny_model_dirs["qwen2"]), progress=False, quantization="none").engine.speculator is None


def test_rejection_sampling_keeps_the_target_distribution():
    """verify_draft's first token, with drafts drawn from q, is distributed as p (20,000 samples)."""
    g = torch.Generator().manual_seed(0)
    vocab = 12
    logits = torch.randn(3, vocab, generator=g) * 2
    q = torch.softmax(torch.randn(2, vocab, generator=g) * 2, -1)
    params = SamplingParams(temperature=1.0)
    row = SamplingRow(params, [1, 2], [], None)
    p = torch.softmax(logits[0], -1)
    counts = torch.zeros(vocab)
    for _ in range(20000):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        out = verify_draft(logits, Draft(d, q), row, g)
        counts[out[0]] += 1
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_critical(df), (stat, df)
    # a point-mass draft (n-gram) too
    counts.zero_()
    for _ in range(20000):
        out = verify_draft(logits, Draft([3, 5]), row, g)
        counts[out[0]] += 1
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_critical(df), (stat, df)


@pytest.mark.parametrize("draft_vocab", [0, 200])
def test_speculative_sampling_matches_plain_sampling_distribution(engines, draft_vocab):
    """Engine level, with a draft model (whole or partial head), 4,000 samples: the plumbing around
    verify_draft (whose arithmetic test_rejection_sampling_keeps_the_target_distribution checks on 20,000).
    At most 64 tokens can come second (top_k 8 twice), so cells expect about 60 samples on average and a
    residual drawn from p instead of (p - q)+ is rejected far past the 0.999 quantile."""
    spec = engines("draft", speculative_max_batch=100000, max_num_seqs=256, max_num_batched_tokens=100000,
                   speculative_draft_vocab=draft_vocab)
    # short prompt: the 10,000 prefills stay cheap
    assert_second_token_keeps_the_target_distribution(engines(), spec, prompts(1, 9)[0][:4], 4000)


def test_draft_head_subset_and_prompt_in_the_first_step(engines):
    """The draft head keeps ids < speculative_draft_vocab plus the special tokens, and the draft model's
    prompt KV is computed in the step that completes the target's prompt (time to first token), not in
    the first speculative step."""
    llm = engines("draft", speculative_max_batch=64, speculative_draft_vocab=200)
    eng = llm.engine
    keep = eng.speculator.drafter.keep
    base = eng.tokenizer.backend.get_vocab_size(with_added_tokens=False)
    assert keep.tolist() == list(range(200)) + list(range(base, eng.model_config.vocab_size))
    assert eng.speculator.drafter.runner.model.lm_head.out_features == keep.numel()
    prompt = (prompts(1, 31)[0] * 40)[:40]  # 40 tokens: two full blocks for the draft's prefix cache
    computed = []
    execute = eng.speculator.drafter.runner.execute
    eng.speculator.drafter.runner.execute = lambda batch: computed.append(sum(s.num_new_tokens for s in batch)) or execute(batch)
    try:
        for rid in ("p", "again"):
            computed.clear()
            eng.add_request(rid, prompt, SamplingParams(max_tokens=4, **GREEDY))
            eng.step()  # the whole prompt fits one step
            (shadow, _), = eng.speculator.drafter.shadows.values()
            assert shadow.num_computed_tokens == len(prompt)
            prompt_work = sum(computed)
            while eng.has_unfinished():
                eng.step()
            assert not eng.speculator.drafter.shadows
            if rid == "p":
                assert prompt_work == len(prompt)
            else:  # the same prompt again: the draft's prompt blocks come from its prefix cache
                bs = eng.config.block_size
                assert bs <= 16 and prompt_work == len(prompt) - (len(prompt) - 1) // bs * bs < len(prompt)
    finally:
        eng.speculator.drafter.runner.execute = execute


def test_stress_with_speculation_returns_every_block(engines):
    llm = engines("draft", speculative_max_batch=64, kv_cache_memory=64 * 16 * 512, max_num_seqs=16)
    eng = llm.engine
    rng = random.Random(21)
    live, done = set(), 0
    for i in range(300):
        params = SamplingParams(n=rng.choice([1, 2]), temperature=rng.choice([0.0, 1.0]),
                                max_tokens=rng.randrange(1, 20), seed=i)
        eng.add_request(f"r{i}", prompts(1, 100 + i)[0], params)
        live.add(f"r{i}")
        if i % 3 == 0:
            for out in eng.step():
                if out.finished:
                    live.discard(out.request_id)
                    done += 1
        if rng.random() < 0.1 and live:
            eng.abort(rng.choice(sorted(live)))
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
                done += 1
    assert done == 300 and not live
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert eng.speculator.drafter.block_manager.num_free_blocks == eng.speculator.drafter.block_manager.num_blocks
    assert not eng.speculator.drafter.shadows


def test_ngram_drafter_proposes_the_continuation_of_the_latest_match():
    seq = Sequence("r", 0, [5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 3, 5, 6, 7], 3, SamplingParams(), 0, 0.0, 100)
    d = NgramDrafter(min_n=2, max_n=3).propose([seq], [3])[0]
    assert d.token_ids == [9, 3, 5]  # the latest earlier "5 6 7" was followed by 9 3 5


def test_draft_with_another_tokenizer_is_refused(tiny_model_dirs, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dirs["qwen2"], other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = list(vocab)[100], list(vocab)[101]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(SuduError, match="different tokenizer"):
        LLM(str(tiny_model_dirs["qwen2"]), progress=False, speculative=f"draft:{other}")
