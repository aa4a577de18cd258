"""Speculative decoding test fixtures: a target engine with each drafter, a deliberately poor draft model,
repetitive prompts, and the chi-square check that a sampler keeps the target's distribution."""
import math
import random

import pytest
import torch

from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams
from tests.helpers.greedy import GREEDY
from tests.helpers.tiny_models import save_tiny_model




def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z = 3.09 is the 0.999 quantile of N(0, 1)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5
    stat = float((((counts - expected) ** 2) / expected)[keep].sum())
    return stat, int(keep.sum()) - 1


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A second tiny qwen2 with the same tokenizer and different weights: a draft that is often wrong."""
    return save_tiny_model(tmp_path_factory.mktemp("draft") / "qwen2-draft", "qwen2", seed=5)


@pytest.fixture(scope="module")
def engines(tiny_model_dirs, draft_dir):
    target = str(tiny_model_dirs["qwen2"])
    cache = {}

    def get(spec="none", **cfg):
        key = (spec, tuple(sorted(cfg.items())))
        if key not in cache:
            spec_arg = {"none": "none", "ngram": "ngram", "draft": f"draft:{draft_dir}", "self": f"draft:{target}"}[spec]
            cache[key] = LLM(target, progress=False, speculative=spec_arg, **cfg)
        return cache[key]

    return get


def prompts(n, seed):
    g = random.Random(seed)
    out = []
    for i in range(n):
        base = [g.randrange(380) for _ in range(g.randrange(3, 12))]
        out.append(base * g.randrange(1, 4))  # repetition gives the n-gram drafter something to find
    return out


def assert_second_token_keeps_the_target_distribution(plain, spec, prompt, samples: int) -> None:
    """The second generated token's distribution under `spec` (top_k=8, temperature 1) equals the exact
    marginal computed from `plain`'s own logits: sum over token 1 of p(t1) p(t2 | t1) (chi-square at the
    0.999 quantile)."""
    first = plain.generate([prompt], SamplingParams(max_tokens=1, logprobs=8, **GREEDY))[0].outputs[0].logprobs[0]
    marginal = torch.zeros(plain.engine.model_config.vocab_size)
    top1 = torch.tensor([lp for _, _, lp in first.top]).softmax(-1)
    for (t1, _, _), p1 in zip(first.top, top1):
        nxt = plain.generate([prompt + [t1]], SamplingParams(max_tokens=1, logprobs=8, **GREEDY))[0]
        lp2 = nxt.outputs[0].logprobs[0]
        p2 = torch.tensor([lp for _, _, lp in lp2.top]).softmax(-1)
        for (t2, _, _), pr in zip(lp2.top, p2):
            marginal[t2] += float(p1 * pr)
    results = spec.generate([prompt] * samples, SamplingParams(temperature=1.0, top_k=8, max_tokens=3, ignore_eos=True))
    counts = torch.zeros_like(marginal)
    for r in results:
        counts[r.token_ids[1]] += 1
    assert spec.engine.speculator.num_draft_tokens > 1000
    stat, df = chi2_stat(counts, marginal)
    assert stat < chi2_critical(df), (stat, df)
