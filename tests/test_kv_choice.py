"""`--kv-cache-dtype auto` (engine/kv_choice.py): measured at load into a concrete pool format, which
everything downstream (pool, context cache namespace, drafters) then sees."""
from __future__ import annotations

import pytest
import torch

from sudu.engine import kv_choice
from sudu.engine.llm import LLM
from sudu.layers.kv_cache import Int8KVCache
from sudu.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 21, 8] * 3, [7, 3, 30]]


def load(path, **cfg) -> LLM:
    return LLM(str(path), progress=False, **cfg)


def test_auto_resolves_to_a_measured_format(tiny_model_dirs):
    llm = load(tiny_model_dirs["qwen2"])
    engine = llm.engine
    chosen = engine.config.kv_cache_dtype
    assert chosen in ("int8", "float16", "bfloat16")
    assert engine.kv_choice.dtype == chosen
    figures = engine.kv_choice.figures
    assert 0.0 <= figures["int8_agreement"] <= 1.0 and figures["check_tokens"] > 100
    assert 0.0 <= figures["float16_agreement"] <= 1.0
    int8_holds = figures["int8_agreement"] >= kv_choice.MIN_AGREEMENT and figures["int8_ppl_rise"] <= kv_choice.MAX_PPL_RISE
    assert (chosen == "int8") == int8_holds
    expected = {"int8": torch.int8, "float16": torch.float16, "bfloat16": torch.bfloat16}[chosen]
    assert all(c.k.dtype == expected and c.v.dtype == expected for c in engine.runner.kv_caches)
    # the context cache's namespace names the pool's real format, never "auto"
    assert engine.block_manager is not None
    from sudu.cache.context import engine_namespace

    _, description = engine_namespace(engine.config, engine.model_config, engine.model_path, engine.quantization,
                                      engine.runner.kv_caches, engine.runner.dtype, engine.runner.device)
    assert description["kv_cache_dtype"] == chosen


@pytest.mark.parametrize("bars,expected", [
    (dict(MIN_AGREEMENT=0.0, MAX_PPL_RISE=1.0), "int8"),  # any int8 result holds
    (dict(MIN_AGREEMENT=1.01), "float16"),  # int8 can never hold; the tiny model's values fit float16
    (dict(MIN_AGREEMENT=1.01, FLOAT16_HEADROOM=1e9), "bfloat16"),  # nothing fits float16 with that headroom
])
def test_the_check_picks_by_its_bars(tiny_model_dirs, monkeypatch, bars, expected):
    for name, value in bars.items():
        monkeypatch.setattr(kv_choice, name, value)
    llm = load(tiny_model_dirs["llama"])
    assert llm.engine.config.kv_cache_dtype == expected
    assert expected in llm.engine.kv_choice.reason or llm.engine.kv_choice.dtype == expected
    if expected == "int8":
        # the pools' scales come from the check's calibration pass: the same as an explicit int8 engine's
        explicit = load(tiny_model_dirs["llama"], kv_cache_dtype="int8")
        for a, b in zip(llm.engine.runner.kv_caches, explicit.engine.runner.kv_caches):
            assert isinstance(a, Int8KVCache) and torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)
            assert torch.equal(a.k_centre, b.k_centre)
        got = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
        assert got == [r.token_ids for r in explicit.generate(PROMPTS, GREEDY)]


def test_explicit_formats_and_other_devices_skip_the_check(tiny_model_dirs, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the check ran")

    monkeypatch.setattr(kv_choice, "_scores", fail)
    llm = load(tiny_model_dirs["qwen2"], kv_cache_dtype="bfloat16")
    assert llm.engine.config.kv_cache_dtype == "bfloat16"
    assert all(c.k.dtype == torch.bfloat16 for c in llm.engine.runner.kv_caches)
    model = llm.engine.runner.model
    assert kv_choice.choose("auto", model, llm.tokenizer, torch.device("cuda"), torch.bfloat16).dtype == "bfloat16"
    assert kv_choice.choose("auto", model, llm.tokenizer, torch.device("cpu"), torch.bfloat16).dtype == "bfloat16"


def test_bad_kv_cache_dtype_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        load(tiny_model_dirs["qwen2"], kv_cache_dtype="fp8")


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_16_bit_pools_decode_close_to_float32(tiny_model_dirs, kv):
    """A 16-bit pool changes each stored value by at most half its last bit: the first step's logprobs stay
    close to the float32 pool's."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    ref = load(tiny_model_dirs["qwen2"], kv_cache_dtype="float32").generate(PROMPTS, params)
    got = load(tiny_model_dirs["qwen2"], kv_cache_dtype=kv).generate(PROMPTS, params)
    tol = {"float16": 2e-3, "bfloat16": 2e-2}[kv]
    for a, b in zip(ref, got):
        assert abs(a.outputs[0].logprobs[0].logprob - b.outputs[0].logprobs[0].logprob) < tol


def test_a_later_load_reuses_the_stored_result(tiny_model_dirs, tmp_path, monkeypatch):
    """The check runs once per weights: a new process (the in-process memo empty) reads the result kept in
    $SUDU_HOME instead of running it again; other weights are checked anew."""
    monkeypatch.setenv("SUDU_HOME", str(tmp_path))
    monkeypatch.setattr(kv_choice, "_MEMO", {})
    first = load(tiny_model_dirs["qwen2"]).engine.config.kv_cache_dtype
    assert (tmp_path / "kv_choice.json").exists()
    monkeypatch.setattr(kv_choice, "_MEMO", {})
    calls = []
    real = kv_choice.choose
    monkeypatch.setattr(kv_choice, "choose", lambda *a: calls.append(a) or real(*a))
    again = load(tiny_model_dirs["qwen2"])
    assert again.engine.config.kv_cache_dtype == first and not calls
    assert "earlier load" in again.engine.kv_choice.reason
    load(tiny_model_dirs["llama"])
    assert len(calls) == 1
