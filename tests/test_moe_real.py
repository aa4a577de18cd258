"""Expert execution on real weights: the catalog's 0.5B cut into a mixture of 8 experts of 608 columns per
layer (benchmarks/moe_synthetic.py). With all 8 selected and unit gates the MoE computes the dense FFN as a
sum of column blocks: float32 logits equal the dense model's up to summation order, and greedy output is
identical. Built in memory (the directory the benchmark writes is 2.5 GB). In int8 the two differ by more
than summation order (a last-bit difference can round an activation to the next int8 step in a later
layer); the benchmark's engine run reports greedy agreement there."""
from __future__ import annotations

import pytest
import torch

from benchmarks.moe_synthetic import DENSE, NUM_EXPERTS, PROMPTS, moe_config, moe_tensors
from sudu.engine.text_eval import text_logits
from sudu.engine.network import load_network
from sudu.model_config import ModelConfig
from sudu.weights.loader import load_checkpoint

pytestmark = pytest.mark.slow


def greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(text_logits(model, ids)[-1].argmax()))
    return ids[-n:]


def test_all_experts_with_unit_gates_reproduce_the_dense_model():
    ckpt = load_checkpoint(DENSE, progress=False)
    state = ckpt.state_dict()  # dequantized once for both networks
    dense = load_network(ckpt.config, state.items(), torch.float32)
    moe_cfg = ModelConfig.from_hf_config(moe_config(ckpt, NUM_EXPERTS, None))
    moe = load_network(moe_cfg, moe_tensors(state.items(), ckpt.config, None), torch.float32)
    assert moe_cfg.num_experts == NUM_EXPERTS and moe_cfg.num_experts_per_tok == NUM_EXPERTS
    ids = ckpt.tokenizer.encode(PROMPTS[0])
    torch.testing.assert_close(text_logits(moe, ids), text_logits(dense, ids), atol=2e-3, rtol=1e-4)
    assert greedy(moe, ids, 8) == greedy(dense, ids, 8)
