"""Expert execution (layers/moe.py): each selected expert runs once per step on all its tokens, an expert
no token chose is never touched, and the result equals a token-by-token reference; routing matches
transformers' routers (softmax top-k, V3's grouped sigmoid with correction bias)."""
from __future__ import annotations

import pytest
import torch

from sudu.engine.network import quantize_model
from sudu.layers.moe import Router, SparseMoE
from sudu.model_config import ModelConfig


def moe_config(**kw) -> ModelConfig:
    base = dict(architecture="qwen3moe", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, norm_topk_prob=True)
    base.update(kw)
    return ModelConfig(**base)


def random_moe(cfg: ModelConfig, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe.eval()


def token_by_token(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    weights, ids = moe.gate(x)
    rows = []
    for t in range(x.shape[0]):
        rows.append(sum(w * moe.experts[int(e)](x[t:t + 1])[0] for w, e in zip(weights[t], ids[t])))
    return torch.stack(rows)


@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
def test_each_selected_expert_runs_once_and_unselected_never(fmt):
    cfg = moe_config()
    moe = random_moe(cfg)
    if fmt != "none":
        quantize_model(moe, None, fmt)
        for m in moe.modules():
            if hasattr(m, "fuse_projections") and m is not moe:
                m.fuse_projections()
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1))  # 6 picks of 8 experts
    _, ids = moe.gate(x)
    chosen = set(ids.flatten().tolist())
    unused = sorted(set(range(cfg.num_experts)) - chosen)
    assert unused and any((ids == e).sum() > 1 for e in chosen)  # some expert serves several tokens
    with torch.no_grad():  # poison the unused experts: reading them would give NaN
        for e in unused:
            for b in moe.experts[e].buffers():
                b.fill_(255 if b.dtype == torch.uint8 else float("nan"))
            for p in moe.experts[e].parameters():
                p.fill_(float("nan"))
    calls = [0] * cfg.num_experts
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, i, o, e=e: calls.__setitem__(e, calls[e] + 1))
    with torch.no_grad():
        out = moe(x)
    assert calls == [1 if e in chosen else 0 for e in range(cfg.num_experts)]
    assert torch.isfinite(out).all()
    with torch.no_grad():
        torch.testing.assert_close(out, token_by_token(moe, x), atol=1e-5, rtol=1e-5)


def test_quantized_experts_rows_do_not_depend_on_the_batch():
    """A token's output is the same whether it runs alone or with others (greedy speculative decoding and
    batching rely on it): int8 kernels per expert, experts summed in a fixed order."""
    cfg = moe_config()
    moe = random_moe(cfg)
    quantize_model(moe, None, "int8")
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        together = moe(x)
        alone = torch.cat([moe(x[t:t + 1]) for t in range(9)])
    assert torch.equal(together, alone)


def test_v3_router_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    ref = DeepseekV3TopkRouter(hf_cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        ref.weight.normal_(0, 0.5)
        ref.e_score_correction_bias.normal_(0, 0.2)
    cfg = moe_config(architecture="deepseek2", hidden_size=64, num_experts=16, num_experts_per_tok=4, n_group=4,
                     topk_group=2, routed_scaling_factor=2.5, scoring_func="sigmoid", router_correction_bias=True)
    router = Router(cfg)
    router.load_state_dict({"weight": ref.weight.detach(), "e_score_correction_bias": ref.e_score_correction_bias})
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, ref_w, ref_ids = ref(x)
        w, ids = router(x)
    # same experts with the same weights (the order within a row is topk's, unsorted on both sides)
    ref_sorted, order = ref_ids.sort(dim=1)
    got_sorted, got_order = ids.sort(dim=1)
    assert torch.equal(got_sorted, ref_sorted)
    torch.testing.assert_close(w.gather(1, got_order), ref_w.gather(1, order))
    # group limit: every token's experts lie in at most topk_group groups
    assert all(len(set((row // 4).tolist())) <= 2 for row in ids)


@pytest.mark.parametrize("scoring,norm,scaling,k", [("softmax", True, 1.0, 2), ("softmax", False, 2.5, 3),
                                                    ("sigmoid", True, 1.0, 4), ("softmax", False, 1.0, 8)])
def test_native_router_matches_the_torch_router(scoring, norm, scaling, k):
    """kernels/moe.cpp moe_route (what the layers and the native decode stack route with on CPU) chooses
    the experts the PyTorch router chooses, with the same weights, and a row's choice does not depend on
    the rows next to it."""
    from sudu import kernels

    if kernels.load() is None:
        pytest.skip("native kernels unavailable")
    cfg = moe_config(num_experts_per_tok=k, norm_topk_prob=norm, scoring_func=scoring, routed_scaling_factor=scaling)
    router = random_moe(cfg).gate
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        w, ids = router(x)
        assert router._native  # the native route was taken
        router._native = False  # the PyTorch path
        ref_w, ref_ids = router(x)
    assert torch.equal(ids, ids.sort(dim=1).values)  # ascending expert ids
    ref_sorted, order = ref_ids.sort(dim=1)
    assert torch.equal(ids, ref_sorted)
    torch.testing.assert_close(w, ref_w.gather(1, order), atol=1e-6, rtol=1e-5)
    router._native = None
    with torch.no_grad():
        alone = [router(x[t:t + 1]) for t in range(0, 40, 7)]
    for t, (wa, ia) in zip(range(0, 40, 7), alone):
        assert torch.equal(ia[0], ids[t]) and torch.equal(wa[0], w[t])
