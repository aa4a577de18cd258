"""The newer architectures through the engine: greedy output equals transformers' generate, and does not
depend on batching, chunked prefill, the prefix cache or the weight format's batch size."""
from __future__ import annotations

import pytest
import torch

from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams
from tests.helpers.greedy import GREEDY, prompts_of
from tests.helpers.tiny_models import build_hf_model, save_tiny_model

ARCHS = ["qwen3", "qwen2moe", "qwen3moe", "mixtral", "deepseek_v3"]


def reference_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' argmax continuation, EOS included (generate's min_new_tokens would mask it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch_models")
    return {arch: save_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_equals_transformers_in_every_schedule(model_dirs, arch):
    hf = build_hf_model(arch, seed=0)
    prompts = prompts_of([3, 21, 40], seed=5)
    params = SamplingParams(max_tokens=10, **GREEDY)
    expected = [reference_greedy(hf, p, 10) for p in prompts]
    for cfg in (dict(), dict(enable_prefix_caching=False, max_num_batched_tokens=16)):
        llm = LLM(str(model_dirs[arch]), progress=False, **cfg)
        assert [r.token_ids for r in llm.generate(prompts, params)] == expected, cfg
        # again, now with the prompts' full blocks in the prefix cache
        again = llm.generate(prompts, params)
        assert [r.token_ids for r in again] == expected
        if cfg.get("enable_prefix_caching", True):
            assert again[2].num_cached_tokens == 32


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_moe_batch_equals_one_by_one(model_dirs, fmt):
    llm = LLM(str(model_dirs["qwen2moe"]), progress=False, quantization=fmt)
    prompts = prompts_of([2, 9, 17, 33, 5, 60, 1, 12], seed=6)
    params = SamplingParams(max_tokens=8, **GREEDY)
    batched = [r.token_ids for r in llm.generate(prompts, params)]
    single = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert batched == single
