"""Real catalog models through sudu's engine against transformers' implementation loaded by transformers'
own GGUF loader (`from_pretrained(..., gguf_file=...)`): its config parsed from the GGUF by transformers
and its weights dequantized by the `gguf` package, so a fault in sudu's config parsing or dequantization
cannot cancel out. Checked: next-token argmax on 22 prompts in one batch (8 on the 1.5B), and a greedy 32-token
completion of a code prompt (16 on the 1.5B), token for token, for the 0.5B and Gemma 3 270M, and for the
1.5B too with SUDU_TEST_ALL_REAL=1 (its 6 GB a side in float32 for the state dict, and four minutes of the
suite); and the dequantized weights tensor by tensor. Slow: marked; the models are pulled from the offline
catalog on first use. Each reference is loaded once for both checks and dropped before sudu's engine loads,
so the 1.5B never holds two float32 copies of its weights at once."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams
from sudu.tokenizer import Tokenizer
from sudu.weights.catalog import CATALOG, pull
from sudu.weights.gguf import open_gguf
from sudu.weights.loader import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("gguf_readers_once")]  # tests/helpers/hf_gguf.py
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "def fibonacci(n):", "import numpy as np\n\narr = np.", "The capital of France is", "SELECT name FROM",
    "class Stack:\n    def __init__(self):", "for i in range(", "# Sort a list in Python\nnums = [3, 1, 2]\n",
    "<html>\n<head>\n<title>", "fn main() {\n    println!(", "const add = (a, b) =>", "Once upon a time",
    "我们的目标是", "async def fetch(url):\n    async with", "x = {'a': 1, 'b': 2}\nfor k, v in x.",
    "#include <stdio.h>\nint main() {", "The quick brown fox", "def is_prime(n):\n    if n < 2:\n        return",
    "git commit -m \"", "1, 1, 2, 3, 5, 8,", "while True:\n    line = input()\n    if not line:",
    "public static void main(String[] args) {", "Q: What is 2 + 2?\nA:",
]
CODE_PROMPT = "def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"


class Reference:
    """transformers' model for one catalog GGUF, config and float32 weights by transformers' own loader, loaded
    once for this module's tests of that model; `drop()` frees it before sudu loads its own copy."""

    def __init__(self, name: str):
        self.name = name
        self.path = pull(name, progress=False)  # from the offline catalog on first use
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(self.path.parent), gguf_file=self.path.name, dtype=torch.float32, attn_implementation="eager").eval()

    def drop(self) -> None:
        self.model = None
        gc.collect()


# The 1.5B (the 0.5B's architecture, loader and kernels at larger widths) costs about four minutes of the
# suite's two workers here, a quarter of its ten-minute budget: it is checked with SUDU_TEST_ALL_REAL=1
# (before a release, or when its shapes' code changes)
MODELS = list(CATALOG) if os.environ.get("SUDU_TEST_ALL_REAL") else ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"]


@pytest.fixture(scope="module", params=MODELS)
def reference(request):
    ref = Reference(request.param)
    yield ref
    ref.drop()




def test_state_dict_matches_transformers(reference):
    """Every tensor sudu's loader gives (dequantized to float32, renamed to transformers' keys) equals the one
    transformers' loader gives, and none is missing."""
    expected = reference.model.state_dict()
    ck = load_checkpoint(reference.name, pull=False, progress=False)
    seen = set()
    for key, tensor in ck.tensors():
        assert key in expected, key
        torch.testing.assert_close(tensor, expected[key].float(), rtol=0, atol=1e-6, msg=key)
        seen.add(key)
    missing = {k for k in expected if k not in seen and not k.endswith("rotary_emb.inv_freq")}
    if ck.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    assert not missing


def reference_tokens(model, prompts, code, num_tokens: int):
    """The reference's next token after each prompt and its greedy num_tokens-token completion of `code`."""
    with torch.inference_mode():
        nexts = [int(model(torch.tensor([p]), logits_to_keep=1).logits[0, -1].argmax()) for p in prompts]
        completion = model.generate(torch.tensor([code]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                    do_sample=False,
                                    attention_mask=torch.ones(1, len(code), dtype=torch.long))[0, len(code):].tolist()
    return nexts, completion


# the 1.5B's float32 reference costs about three times the 0.5B's per token: its share of the suite's time
# is kept near theirs with fewer prompts and a shorter completion (the same checks, the same architecture)
LARGE = {"qwen2.5-coder-1.5b-instruct": (8, 16)}


def test_engine_matches_transformers_on_real_model(reference):
    name = reference.name
    tok = Tokenizer.from_gguf(open_gguf(reference.path))  # the same ids go to both sides; tokenization: test_real_models.py
    num_prompts, num_tokens = LARGE.get(name, (len(PROMPTS), 32))
    prompts = [tok.encode(p) for p in PROMPTS[:num_prompts]]
    code = tok.encode(CODE_PROMPT)
    want_next, want_completion = reference_tokens(reference.model, prompts, code, num_tokens)
    reference.drop()
    # float32 attention: the network against transformers' float32 forward, token for token (the bfloat16
    # tiles' own price, a near-tie moved here and there, is measured in docs/exactness.md)
    llm = LLM(name, progress=False, kv_cache_memory=256 << 20, max_model_len=2048, quantization="none",
              attention_arithmetic="float32")
    greedy1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    got_next = [r.token_ids[0] for r in llm.generate(prompts, greedy1)]
    assert len(prompts) >= min(num_prompts, 20) and got_next == want_next
    got_completion = llm.generate([code], SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                                         ignore_eos=True))[0].token_ids
    assert got_completion == want_completion, (tok.decode(got_completion), tok.decode(want_completion))
