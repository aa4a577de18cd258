"""Repetition, frequency and presence penalties against logits worked out by hand (exact binary fractions,
so float32 holds them exactly), through the sampler's greedy choice, and in the engine against a
reference loop that applies the OpenAI/vLLM formulas itself to the transformers model's logits."""
import pytest
import torch

from sudu.engine.llm import LLM
from sudu.layers.sampler import Sampler, SamplingRow, apply_penalties
from sudu.sampling import SamplingParams
from tests.helpers.tiny_models import build_hf_model

LOGITS = [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]
PROMPT = [0, 1, 5]  # token 5's logit is 0: a repetition penalty leaves it at 0 either way
OUTPUT = [4, 4, 2]  # token 4 twice, token 2 once; tokens 0, 1 and 5 only in the prompt


def penalized(**params):
    row = SamplingRow(SamplingParams(**params), list(PROMPT), list(OUTPUT), generator=None)
    return apply_penalties(torch.tensor(LOGITS), row).tolist()


@pytest.mark.parametrize("params, want", [
    # seen in prompt or output (0, 1, 2, 4, 5): positive logits divided by 2, negative ones multiplied by 2
    (dict(repetition_penalty=2.0), [1.0, -2.0, 0.25, -0.5, 1.5, 0.0]),
    # a penalty under 1 rewards repetition the same way
    (dict(repetition_penalty=0.5), [4.0, -0.5, 1.0, -0.5, 6.0, 0.0]),
    # output counts only: 4 loses 2 x 0.5, 2 loses 1 x 0.5; prompt tokens untouched
    (dict(frequency_penalty=0.5), [2.0, -1.0, 0.0, -0.5, 2.0, 0.0]),
    (dict(frequency_penalty=-0.5), [2.0, -1.0, 1.0, -0.5, 4.0, 0.0]),
    # once per generated token, however often it came
    (dict(presence_penalty=0.25), [2.0, -1.0, 0.25, -0.5, 2.75, 0.0]),
    # repetition first, then frequency and presence: 4: 3/2 - 2*0.5 - 0.25 = 0.25; 2: 0.5/2 - 0.5 - 0.25 = -0.5
    (dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), [1.0, -2.0, -0.5, -0.5, 0.25, 0.0]),
    (dict(), LOGITS),
])
def test_penalties_match_hand_computed_logits(params, want):
    assert penalized(**params) == want


def test_frequency_and_presence_wait_for_output_tokens():
    row = SamplingRow(SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), [4, 4, 2], [], generator=None)
    assert apply_penalties(torch.tensor(LOGITS), row).tolist() == LOGITS


def test_greedy_choice_follows_the_penalized_logits():
    """Unpenalized the argmax is token 4 (3.0); penalized (the last case above) it is token 0 (1.0). The
    reported logprob stays that of the raw distribution."""
    logits = torch.tensor([LOGITS, LOGITS])
    plain = SamplingParams(temperature=0.0, logprobs=0)
    strict = SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    rows = [SamplingRow(plain, list(PROMPT), list(OUTPUT), None), SamplingRow(strict, list(PROMPT), list(OUTPUT), None)]
    a, b = Sampler()(logits, rows)
    raw = torch.log_softmax(torch.tensor(LOGITS), -1)
    assert (a.token_id, b.token_id) == (4, 0)
    assert b.logprob == pytest.approx(float(raw[0]))


def reference_penalized_greedy(hf, prompt, n, rep, freq, pres):
    """Greedy decoding of transformers' model with the penalties applied here, from their definitions."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1].double().tolist()
        seen = set(prompt) | set(out)
        for t in seen:
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        nxt = max(range(len(logits)), key=lambda i: (logits[i], -i))
        out.append(nxt)
        tokens.append(nxt)
    return out


def test_engine_penalized_greedy_equals_a_reference_loop(tiny_model_dirs):
    hf = build_hf_model("qwen2", seed=0)
    # float weights and a float32 KV pool: the tiny random model's logits sit within 1e-3 of each other, so
    # the engine's numbers must be the reference's to far better than that
    llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, quantization="none", kv_cache_dtype="float32")
    prompt = [7, 19, 7, 250, 3, 19]
    for rep, freq, pres in ((1.5, 0.0, 0.0), (1.0, 1.0, 0.0), (1.0, 0.0, 2.0), (1.3, 0.4, 0.6)):
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=rep,
                                frequency_penalty=freq, presence_penalty=pres)
        got = llm.generate([prompt], params)[0].token_ids
        assert got == reference_penalized_greedy(hf, prompt, 16, rep, freq, pres), (rep, freq, pres)
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    assert plain == reference_penalized_greedy(hf, prompt, 16, 1.0, 0.0, 0.0)
