"""Long-context retrieval: an access code hidden at a seeded depth in a long filler document whose
length is a fraction of the model's context. The answer passes only if the one number it gives is
the code (no hedging with several numbers)."""
from __future__ import annotations

import re

import numpy as np

from sudu.bench.tasks import CheckResult, TaskInstance, strip_reasoning
from sudu.bench.workloads import filler_text

ANSWER_BUDGET_TOKENS = 64
TOKENS_PER_WORD = 1.35  # the filler's words plus punctuation, measured roughly on BPE tokenizers
_NUMBER = re.compile(r"\d[\d,]*\d|\d")


def check(answer: str, code: str) -> CheckResult:
    numbers = {n.replace(",", "") for n in _NUMBER.findall(strip_reasoning(answer))}
    if not numbers:
        return CheckResult(False, "no number in the answer")
    if numbers != {code}:
        return CheckResult(False, f"expected only {code}, got {', '.join(sorted(numbers))}")
    return CheckResult(True, "code found")


def build(context_len: int, seed: int = 0, fraction: float = 0.5) -> TaskInstance:
    rng = np.random.default_rng(seed + 1234)
    code = str(int(rng.integers(10000, 99999)))
    target_tokens = max(64, int(context_len * fraction) - ANSWER_BUDGET_TOKENS)
    num_words = max(48, int(target_tokens / TOKENS_PER_WORD))
    depth = float(rng.uniform(0.1, 0.9))
    doc = filler_text(num_words, seed).split(". ")
    cut = int(len(doc) * depth)
    fact = f"The access code for the north vault is {code}"
    text = ". ".join(doc[:cut] + [fact] + doc[cut:])
    user = (
        "Read the document below and answer the question after it.\n\n<document>\n" + text + "\n</document>\n\n"
        "Question: what is the access code for the north vault? Answer with the number only."
    )
    return TaskInstance(
        name="retrieval",
        messages=[{"role": "user", "content": user}],
        check=lambda answer: check(answer, code),
        max_tokens=ANSWER_BUDGET_TOKENS,
        info={"approx_prompt_tokens": int(num_words * TOKENS_PER_WORD), "depth": round(depth, 3), "context_len": context_len},
    )
