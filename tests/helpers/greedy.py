"""Token-level helpers for engine tests: greedy parameters, random prompts, the transformers greedy
reference and the agreement between two engines."""
import random

import torch

from sudu.sampling import SamplingParams


GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_of(lengths, vocab=380, seed=0):
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy_agreement(a, b, prompts, max_tokens: int) -> float:
    """Fraction of greedy tokens two engines agree on, position by position."""
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    ta = [r.token_ids for r in a.generate(prompts, params)]
    tb = [r.token_ids for r in b.generate(prompts, params)]
    return sum(x == y for ra, rb in zip(ta, tb) for x, y in zip(ra, rb)) / sum(map(len, ta))


def reference_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()
