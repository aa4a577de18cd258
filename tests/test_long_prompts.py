"""Long prompts: past 4,096 positions a tiny model's greedy tokens still equal transformers' (float32 pool,
float32 attention), and with the bfloat16 tiles a deep prompt gives the same answer in one chunk, in chunks
of 512 and over a cached prefix (the attention kernels at depth: many key blocks, prompt items far from the
first key)."""
from __future__ import annotations

import random

from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams
from tests.helpers.greedy import reference_greedy
from tests.helpers.native_blocks import needs_bf16_tiles
from tests.helpers.tiny_models import build_hf_model, save_tiny_model

LENGTH, TOKENS = 4500, 8


def long_prompt(seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, 250) for _ in range(LENGTH)]


def test_greedy_tokens_past_4k_positions_equal_transformers(tmp_path):
    path = save_tiny_model(tmp_path / "qwen2", "qwen2", max_position_embeddings=8192)
    hf = build_hf_model("qwen2", 0, max_position_embeddings=8192).eval()
    prompt = long_prompt(1)
    want = reference_greedy(hf, prompt, TOKENS)
    llm = LLM(str(path), progress=False, kv_cache_dtype="float32", speculative="none")
    assert llm.engine.runner.attention_arithmetic == "float32"
    got = llm.generate([prompt], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == want


@needs_bf16_tiles
def test_a_deep_prompt_on_the_tiles_is_the_same_in_every_chunking(tmp_path):
    path = save_tiny_model(tmp_path / "qwen2-hd32", "qwen2", head_dim=32, max_position_embeddings=8192)
    prompt = long_prompt(2)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    common = dict(progress=False, kv_cache_dtype="float16", speculative="none", quantization="int8",
                  enable_prefix_caching=False)

    def answer(llm, cached: int = 0):
        r = llm.generate([prompt], params)[0]
        assert r.num_cached_tokens >= cached  # the cache really served the prefix
        return r.token_ids, [lp.logprob for lp in r.outputs[0].logprobs]

    whole = LLM(str(path), max_num_batched_tokens=8192, **common)
    assert whole.engine.runner.attention_arithmetic == "bfloat16"
    want = answer(whole)
    assert answer(LLM(str(path), max_num_batched_tokens=512, **common)) == want
    cached = LLM(str(path), **{**common, "enable_prefix_caching": True})
    cached.generate([prompt[:3000]], SamplingParams(max_tokens=1))
    assert answer(cached, cached=2048) == want
