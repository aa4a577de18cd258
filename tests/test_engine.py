"""Engine behaviour a user would notice: greedy output equals the transformers reference and does not
depend on batch composition, prefix caching, chunk size or preemption; the prefix cache reports and
skips what it serves; sampling is reproducible by seed; stop conditions are exact; nothing leaks."""
import random

import pytest
import torch

from sudu.engine.llm import LLM
from sudu.errors import RequestTooLongError
from sudu.sampling import SamplingParams
from tests.helpers.tiny_models import build_hf_model
from tests.helpers.greedy import GREEDY, greedy_agreement, prompts_of, reference_greedy

@pytest.fixture(scope="module")
def llms(tiny_model_dirs):
    cache = {}

    def get(arch="qwen2", **cfg):
        key = (arch, tuple(sorted(cfg.items())))
        if key not in cache:
            cache[key] = LLM(str(tiny_model_dirs[arch]), progress=False, **cfg)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_greedy_equals_transformers(llms, arch):
    hf = build_hf_model(arch, seed=0)
    llm = llms(arch)
    prompts = prompts_of([3, 11, 20], seed=1)  # 20 > the tiny gemma window of 8
    results = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_greedy(hf, p, 12)
        assert r.finish_reason == "length"


def test_batch_of_16_equals_one_by_one(llms):
    llm = llms()
    prompts = prompts_of([1, 2, 5, 9, 15, 16, 17, 31, 33, 40, 47, 64, 65, 70, 3, 100], seed=2)
    params = SamplingParams(max_tokens=10, **GREEDY)
    batched = [r.token_ids for r in llm.generate(prompts, params)]
    single = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert batched == single


@pytest.mark.parametrize("cfg", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=64),
    dict(max_num_batched_tokens=100000),
    dict(kv_cache_blocks=24),  # 24 blocks of 16 tokens: forces preemption
])
def test_greedy_identical_across_engine_configs(llms, cfg):
    prompts = prompts_of([5, 40, 70, 100, 130, 17, 64, 90], seed=3)
    params = SamplingParams(max_tokens=24, **GREEDY)
    base = [r.token_ids for r in llms().generate(prompts, params)]
    if "kv_cache_blocks" in cfg:  # the pool's size in bytes for the format auto chose
        runner = llms().engine.runner
        cfg = dict(kv_cache_memory=cfg["kv_cache_blocks"] * 16 * runner.kv_bytes_per_token(),
                   kv_cache_dtype=runner.config.kv_cache_dtype)
    llm = llms(**cfg)
    got = [r.token_ids for r in llm.generate(prompts, params)]
    assert got == base
    if "kv_cache_memory" in cfg:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_repeated_request_is_served_from_prefix_cache(llms):
    llm = llms()
    prompt = prompts_of([75], seed=4)[0]
    params = SamplingParams(max_tokens=4, **GREEDY)
    first = llm.generate([prompt], params)[0]
    computed_before = llm.engine.num_computed_tokens
    second = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64  # 4 full blocks of 16; the 75th token is always recomputed
    # prefill computed only the uncached 11 tokens; the 3 later decode steps one token each
    assert llm.engine.num_computed_tokens - computed_before == (75 - 64) + 3
    assert second.token_ids == first.token_ids


def test_request_that_can_never_fit_fails_at_admission(llms):
    llm = llms(max_model_len=64)
    with pytest.raises(RequestTooLongError, match="64"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(RequestTooLongError):
        llm.generate([[1] * 64], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())


def test_seeded_sampling_reproducible_across_batch_compositions(llms):
    llm = llms()
    target = prompts_of([12], seed=5)[0]
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([target], p)[0].token_ids
    others = prompts_of([3, 30, 7], seed=6)
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 2 + [p]
                         + [SamplingParams(max_tokens=5, **GREEDY)])[2].token_ids
    assert alone == mixed
    other_seed = llm.generate([target], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99,
                                                       max_tokens=16, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_stop_string_across_token_boundary_is_never_emitted(llms):
    llm = llms()
    tok = llm.tokenizer

    def find_case():
        # a random model emits byte fragments too: look for three plain-text tokens in a row, and a stop
        # string from the last character of the first to the first character of the third
        for seed in range(50):
            prompt = prompts_of([9], seed=1000 + seed)[0]
            params = dict(temperature=1.0, seed=seed, max_tokens=30, ignore_eos=True)
            full = llm.generate([prompt], SamplingParams(**params))[0]
            text, ids = full.text, full.token_ids
            for i in range(1, len(ids) - 3):
                if not all(tok.decode([t]).isascii() and tok.decode([t]).strip() for t in ids[i:i + 3]):
                    continue
                start = len(tok.decode(ids[:i + 1])) - 1
                stop = text[start:len(tok.decode(ids[:i + 2])) + 1]
                if text.find(stop) == start and text[:start] == tok.decode(ids[:i + 1])[:-1]:
                    return prompt, params, text, start, stop
        pytest.fail("no sample with three plain-text tokens in a row")

    prompt, params, text, start, stop = find_case()
    got = llm.generate([prompt], SamplingParams(stop=[stop], **params))[0]
    assert got.text == text[:start]
    assert got.finish_reason == "stop" and got.outputs[0].stop_reason == stop


def test_eos_and_stop_token_ids_end_generation(llms):
    llm = llms()
    prompt = prompts_of([9], seed=8)[0]
    ids = llm.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0].token_ids
    stop_tok = ids[6]
    got = llm.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop_tok], **GREEDY))[0]
    assert got.token_ids == ids[: ids.index(stop_tok) + 1]
    assert got.finish_reason == "stop" and got.outputs[0].stop_reason == stop_tok


def test_logprobs_with_top_alternatives(llms, tiny_model_dirs):
    llm = llms(kv_cache_dtype="float32")  # compared with transformers' float32 within 1e-4
    hf = build_hf_model("qwen2", seed=0)
    prompt = prompts_of([10], seed=9)[0]
    r = llm.generate([prompt], SamplingParams(max_tokens=3, logprobs=5, **GREEDY))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + r.token_ids])).logits[0].float(), -1)
    for i, lp in enumerate(r.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == r.token_ids[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        assert [t for t, _, _ in lp.top] == torch.topk(row, 5).indices.tolist()


def test_n_choices_share_the_prompt_blocks(llms):
    llm = llms()
    prompt = prompts_of([50], seed=10)[0]
    hits_before = llm.engine.block_manager.stats.hits
    r = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in r.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in r.outputs)
    assert len({tuple(c.token_ids) for c in r.outputs}) > 1
    assert llm.engine.block_manager.stats.hits - hits_before == 2 * 48  # two siblings x 3 full blocks


def test_randomized_stress_returns_every_block(llms):
    """1,000 requests with random lengths, n > 1 and aborts under a small pool; every request ends and
    every block comes back."""
    llm = llms(kv_cache_memory=96 * 16 * 512, max_num_seqs=32, max_num_batched_tokens=256)
    eng = llm.engine
    rng = random.Random(12)
    live, finished, aborted = set(), set(), set()
    next_id = 0
    while next_id < 1000 or eng.has_unfinished():
        for _ in range(rng.randrange(0, 12)):
            if next_id >= 1000:
                break
            rid = f"s{next_id}"
            next_id += 1
            prompt = [rng.randrange(380) for _ in range(rng.randrange(1, 60))]
            params = SamplingParams(n=rng.choice([1, 1, 1, 2, 3]), temperature=rng.choice([0.0, 0.8]),
                                    max_tokens=rng.randrange(1, 12), seed=rng.randrange(100))
            eng.add_request(rid, prompt, params, priority=rng.randrange(3))
            live.add(rid)
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
                finished.add(out.request_id)
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            eng.abort(victim)
            aborted.add(victim)
    assert len(finished) == 1000 and not live
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert all(b.ref_count == 0 for b in eng.block_manager.blocks)
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_long_prompt_advances_in_small_chunks_while_others_decode(llms):
    """Long/short mixing: while streams decode, a long prompt gets at most prefill_chunk_when_decoding
    tokens a step, so each step stays short and every decoder advances; alone it takes the full budget."""
    llm = llms(max_num_batched_tokens=256, prefill_chunk_when_decoding=32)
    eng = llm.engine
    for i, p in enumerate(prompts_of([8, 9, 10, 11], seed=13)):
        eng.add_request(f"d{i}", p, SamplingParams(max_tokens=40, **GREEDY))
    eng.step()  # the four short prompts' prefill
    eng.add_request("long", prompts_of([300], seed=14)[0], SamplingParams(max_tokens=1, **GREEDY))
    long_seq = eng.requests["long"].seqs[0]
    chunks = []
    for _ in range(5):
        before = long_seq.num_computed_tokens
        outs = eng.step()
        chunks.append(long_seq.num_computed_tokens - before)
        assert {o.request_id for o in outs if o.outputs} >= {f"d{i}" for i in range(4)}
    assert chunks == [32] * 5
    while eng.has_unfinished():
        eng.step()
    eng.add_request("alone", prompts_of([300], seed=15)[0], SamplingParams(max_tokens=1, **GREEDY))
    alone = eng.requests["alone"].seqs[0]
    eng.step()
    assert alone.num_computed_tokens == 256
    while eng.has_unfinished():
        eng.step()


def test_int8_kv_cache_holds_twice_the_tokens_and_stays_close(llms):
    """int8 KV: one byte per value and static per-channel scales, so exactly twice the tokens of a 16-bit
    pool in the same bytes; greedy output close to the float pool's on a tiny model (the real-model accuracy
    check is slow-marked)."""
    budget = 64 * 16 * 512
    f32 = llms(kv_cache_memory=budget, kv_cache_dtype="float32")
    i8 = llms(kv_cache_memory=budget, kv_cache_dtype="int8")
    bf16_bytes = f32.engine.runner.kv_bytes_per_token() // 2
    assert i8.engine.runner.kv_bytes_per_token() * 2 == bf16_bytes
    bf16_tokens = budget // bf16_bytes
    assert i8.engine.runner.num_blocks * 16 == bf16_tokens * 2
    assert greedy_agreement(f32, i8, prompts_of([20, 45, 70], seed=16), 16) >= 0.8
    assert i8.engine.block_manager.num_free_blocks == i8.engine.block_manager.num_blocks


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_int8_kv_scales_cover_the_calibration_pass(llms, arch, monkeypatch):
    """The scales set at load cover every K and V value the calibration pass produced (K around its centre,
    after rotary: both channels of a rotate-half pair share a scale and a bound), V with the margin to spare,
    and values past them saturate instead of wrapping."""
    from sudu.layers import kv_cache as KC
    from sudu.engine import kv_calibration

    seen = []
    record = KC.KVRangeRecorder.write
    monkeypatch.setattr(KC.KVRangeRecorder, "write", lambda self, s, k, v: seen.append((self, k, v)) or record(self, s, k, v))
    eng = llms(arch, kv_cache_dtype="int8").engine
    caches = eng.runner.kv_caches
    ids = KC.calibration_ids(eng.tokenizer, eng.model_config)
    assert len(ids) > 100
    seen.clear()
    kv_calibration.calibrate_int8_kv(eng.runner.model, caches, ids)
    assert len(seen) == len(caches)
    for cache, (_, k, v) in zip(caches, seen):
        half = cache.k_scale.shape[-1] // 2
        assert torch.equal(cache.k_scale[:, :half], cache.k_scale[:, half:])
        assert ((k.float() - cache.k_centre) / cache.k_scale).abs().max() <= 127 * (1 + 1e-5)
        assert (v.float() / cache.v_scale).abs().max() <= 127 / KC.KV_SCALE_MARGIN * (1 + 1e-5)
    cache = caches[0]
    big = torch.full((1, *cache.k_scale.shape), 1e4)
    assert torch.equal(KC.Int8KVCache.quantize(big, cache.k_scale), torch.full(big.shape, 127, dtype=torch.int8))
    assert torch.equal(KC.Int8KVCache.quantize(-big, cache.k_scale), torch.full(big.shape, -127, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="calibrated"):
        KC.Int8KVCache(4, 1, 8).write(torch.arange(1), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8))


def test_gemma_sliding_layers_keep_only_their_window(llms, tiny_model_dirs):
    """Hybrid attention: in the default layout, Gemma's sliding-window layers hold at most a window (plus
    one step) of each sequence, whatever its length, and the output equals the transformers reference
    and the full layout, for prompts far longer than the window (8 in the tiny model)."""
    hf = build_hf_model("gemma3", seed=0)
    ring = llms("gemma3", max_num_batched_tokens=16)
    full = llms("gemma3", max_num_batched_tokens=16, sliding_window_kv="full")
    sliding = ring.engine.block_manager.sliding
    assert sliding is not None and sliding.ring_blocks == -(-(8 + 16) // 16) + 1
    assert full.engine.block_manager.sliding is None
    prompts = prompts_of([40, 90], seed=17)
    params = SamplingParams(max_tokens=20, **GREEDY)
    eng = ring.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, params)
    peak = 0
    results = {}
    while eng.has_unfinished():
        for out in eng.step():
            results.setdefault(out.request_id, []).extend(t for o in out.outputs for t in o.token_ids)
        peak = max([peak] + [sliding.num_held(s) for s in eng.scheduler.running])
    assert peak == sliding.ring_blocks  # 110 tokens would need 7 blocks; the window holds 3
    got = [results[f"g{i}"] for i in range(2)]
    assert got == [reference_greedy(hf, p, 20) for p in prompts]
    assert got == [r.token_ids for r in full.generate(prompts, params)]
    assert sliding.pool.num_free == sliding.num_blocks


def test_auto_chunk_budget_keeps_mixed_steps_within_the_itl_factor():
    """prefill_chunk_when_decoding = 0 (auto): the chunk is sized from measured step times so a mixed step
    costs about max_itl_factor x a decode-only step per prompt in flight, and follows the per-token cost as
    it changes."""
    from sudu.engine.scheduler import ChunkBudget

    b = ChunkBudget(0, ceiling=512, itl_factor=2.5, alpha=1.0)
    # nothing timed yet (a batch queued from the start): a fixed chunk per prompt in flight
    assert b.tokens(num_decoding=4, num_prefilling=1) == ChunkBudget.UNMEASURED
    assert b.tokens(num_decoding=4, num_prefilling=3) == 3 * ChunkBudget.UNMEASURED
    b.observe(num_decodes=0, num_prefill_tokens=512, seconds=9.0)  # prefill alone: no decoder to protect
    assert b.tokens() == ChunkBudget.UNMEASURED
    b.observe(num_decodes=4, num_prefill_tokens=0, seconds=0.040)
    assert b.tokens() == ChunkBudget.INITIAL  # decoders timed, prompt tokens not yet
    b.observe(num_decodes=4, num_prefill_tokens=16, seconds=0.040 + 16 * 0.004)
    assert b.tokens() == 15  # (2.5 - 1) * 40 ms / 4 ms per token
    b.observe(num_decodes=4, num_prefill_tokens=15, seconds=0.040 + 15 * 0.010)  # longer context: dearer tokens
    assert b.tokens() == 6
    b.observe(num_decodes=4, num_prefill_tokens=6, seconds=0.040 + 6 * 0.0001)
    assert b.tokens() == 512  # cheap tokens: up to the step's whole budget
    b.observe(num_decodes=4, num_prefill_tokens=6, seconds=1.0)
    assert b.tokens() == ChunkBudget.FLOOR  # never starves the prompt
    b.observe(num_decodes=4, num_prefill_tokens=15, seconds=0.040 + 15 * 0.004)
    assert b.tokens(num_decoding=4, num_prefilling=1) == 15
    # a queue: each prompt in flight brings its own allowance (capped by the step budget)
    assert b.tokens(num_decoding=4, num_prefilling=10) == 150
    assert b.tokens(num_decoding=4, num_prefilling=400) == 512
    # more decoders than the timed decode-only steps had (a burst admitted with no decode-only step since):
    # their rows are charged at the measured per-row cost, in the estimate and in the undisturbed step
    b.observe(num_decodes=14, num_prefill_tokens=10, seconds=0.040 + 20 * 0.004)
    assert b.per_token_s == pytest.approx(0.004)
    assert b.decode_step_s(14) == pytest.approx(0.040 + 10 * 0.004)
    assert b.tokens(num_decoding=14, num_prefilling=1) == 30  # (2.5 - 1) * 80 ms / 4 ms
    assert ChunkBudget(48, ceiling=512).tokens(1, 100) == 48  # a fixed setting is used as is
