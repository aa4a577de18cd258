"""DeepSeek Sparse Attention (DeepSeek-V3.2, layers/sparse_index.py on layers/mla.py): the attention layer
against a reference written here from the paper (lightning indexer scores, top-k, attention over the
chosen tokens only, with full per-head keys and values), prompt and decode paths over the paged pool; the
whole model against transformers' DeepseekV32; and the engine's greedy tokens unchanged by prefix caching
and chunking."""
from __future__ import annotations

import copy
import math
import tempfile

import pytest
import torch

from sudu.engine.llm import LLM
from sudu.layers.attention import build_metadata
from sudu.layers.kv_cache import KVCache
from sudu.model_config import ModelConfig
from sudu.models import build_model
from sudu.sampling import SamplingParams
from sudu.weights import safetensors as st_weights
from tests.helpers.greedy import GREEDY, prompts_of
from tests.helpers.tiny_models import build_hf_model, save_tiny_model

PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def sudu_from_hf(hf):
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    model = build_model(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        state = dict(st_weights.iter_tensors(d, arch=cfg.architecture))
    model.load_state_dict(state, strict=True)
    return model


def pools(cfg: ModelConfig, slots: int):
    heads, k_dim, v_dim = cfg.kv_cache_shape()
    return [KVCache(slots, heads, k_dim, torch.float32, v_head_dim=v_dim) for _ in range(cfg.num_hidden_layers)]


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_attention(sd: dict, c, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3.2's attention of one layer over a whole sequence of hidden states h [T, hidden], in
    float64, written from the paper: (output [T, hidden], index scores [T, T] with -inf where not visible).
    MLA with full per-head keys (W_UK c ; k_pe) and values (W_UV c); DeepSeek's RoPE on interleaved channel
    pairs; the indexer's RoPE on its first qk_rope_head_dim channels in halves."""
    sd = {k: v.double() for k, v in sd.items()}
    h = h.double()
    T, H = h.shape[0], c.num_attention_heads
    nope, rope, vd, lora = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    theta = 10000.0 ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta  # [T, rope / 2]

    def rope_pairs(x):  # (x0, x1), (x2, x3), ... each pair rotated by its angle
        z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(angle), angle).view(
            T, *([1] * (x.dim() - 2)), rope // 2)
        return torch.stack([z.real, z.imag], dim=-1).flatten(-2)

    def rope_halves(x):  # (x_i, x_{i + rope/2}) rotated by angle i
        a, b = x[..., :rope // 2], x[..., rope // 2:rope]
        cos, sin = angle.cos().view(T, *([1] * (x.dim() - 2)), -1), angle.sin().view(T, *([1] * (x.dim() - 2)), -1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., rope:]], dim=-1)

    p = "self_attn."
    cq = rms(h @ sd[p + "q_a_proj.weight"].T, sd[p + "q_a_layernorm.weight"])
    q = (cq @ sd[p + "q_b_proj.weight"].T).view(T, H, nope + rope)
    q = torch.cat([q[..., :nope], rope_pairs(q[..., nope:])], dim=-1)
    kv = h @ sd[p + "kv_a_proj_with_mqa.weight"].T
    ckv, k_pe = rms(kv[:, :lora], sd[p + "kv_a_layernorm.weight"]), rope_pairs(kv[:, lora:])
    kvb = (ckv @ sd[p + "kv_b_proj.weight"].T).view(T, H, nope + vd)
    k = torch.cat([kvb[..., :nope], k_pe[:, None].expand(T, H, rope)], dim=-1)
    v = kvb[..., nope:]
    # lightning indexer: I(t, s) = sum_j w(t, j) ReLU(q(t, j) . k(s)), t attends to its top-k visible s
    Hi, Di = c.index_n_heads, c.index_head_dim
    iq = rope_halves((cq @ sd[p + "indexer.wq_b.weight"].T).view(T, Hi, Di))
    ik = torch.nn.functional.layer_norm(h @ sd[p + "indexer.wk.weight"].T, (Di,), sd[p + "indexer.k_norm.weight"],
                                        sd[p + "indexer.k_norm.bias"], 1e-6)
    ik = rope_halves(ik)
    w = (h @ sd[p + "indexer.weights_proj.weight"].T) / math.sqrt(Hi)
    index = torch.einsum("th,tsh->ts", w, torch.relu(torch.einsum("thd,sd->tsh", iq, ik) / math.sqrt(Di)))
    index = index.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.empty(T, H, vd, dtype=torch.float64)
    for t in range(T):
        # the paper leaves ties open; sudu's rule: among equal scores the earlier token first
        chosen = index[t, :t + 1].sort(descending=True, stable=True).indices[:c.index_topk]
        scores = torch.einsum("hd,shd->hs", q[t], k[chosen]) / math.sqrt(nope + rope)
        out[t] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[chosen])
    return out.reshape(T, H * vd) @ sd[p + "o_proj.weight"].T, index


def ties_at_the_cut(index: torch.Tensor, topk: int) -> int:
    """Rows whose top-k boundary falls between equal scores (tokens whose every index head's ReLU is 0): there
    the tie rule decides."""
    return sum(int(s[topk - 1] == s[topk]) for s in (index[t, :t + 1].sort(descending=True).values
                                                      for t in range(topk, index.shape[0])))


@pytest.fixture(scope="module")
def hf_plain():
    return build_hf_model("deepseek_v32", seed=2, **PLAIN_ROPE)


def test_attention_layer_matches_the_paper_in_prompt_and_decode(hf_plain):
    model = sudu_from_hf(hf_plain)
    cfg = model.config
    attn = model.model.layers[0].self_attn
    sd = {k[len("model.layers.0."):]: v for k, v in hf_plain.state_dict().items() if k.startswith("model.layers.0.self_attn.")}
    T = 40
    h = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    ref, index = reference_attention(sd, hf_plain.config, h)
    assert ties_at_the_cut(index, cfg.index_topk) > 0  # the tie rule is exercised too
    positions = torch.arange(T)
    cos, sin = model.rotary.lookup(positions, torch.float32)
    # the whole prompt in one pass
    pool = pools(cfg, T)
    with torch.no_grad():
        out = attn(h, cos, sin, build_metadata([T], [torch.arange(T)], pool, None))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    # 30 tokens, then one at a time through the decode path: the pool's index keys serve the later rows
    pool = pools(cfg, T)
    rows = []
    with torch.no_grad():
        rows.append(attn(h[:30], cos[:30], sin[:30], build_metadata([30], [torch.arange(30)], pool, None)))
        for t in range(30, T):
            rows.append(attn(h[t:t + 1], cos[t:t + 1], sin[t:t + 1], build_metadata([1], [torch.arange(t + 1)], pool, None)))
    torch.testing.assert_close(torch.cat(rows).double(), ref, atol=2e-5, rtol=1e-5)
    # the sparsity matters here: with every visible token attended the rows differ
    dense_cfg = copy.copy(hf_plain.config)
    dense_cfg.index_topk = T
    assert (reference_attention(sd, dense_cfg, h)[0] - ref).abs().max() > 1e-3


def test_model_matches_transformers_deepseek_v32():
    # YaRN as in the V3 tiny model; 16 index heads make a zero score (every head's ReLU 0), and with it a tie at
    # the top-k cut that transformers' topk would break its own way, unlikely
    hf = build_hf_model("deepseek_v32", seed=1, index_n_heads=16)
    model = sudu_from_hf(hf)
    g = torch.Generator().manual_seed(0)
    lengths = [3, 17, 40]
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).logits[0] for p in prompts]
    base = [0, 3, 20]
    pool = pools(model.config, sum(lengths))
    ctx = [torch.arange(b, b + n) for b, n in zip(base, lengths)]
    with torch.no_grad():
        out = model.compute_logits(model(torch.tensor(sum(prompts, [])),
                                         torch.cat([torch.arange(n) for n in lengths]),
                                         build_metadata(lengths, ctx, pool, None)))
    for i, (b, n) in enumerate(zip(base, lengths)):
        torch.testing.assert_close(out[b:b + n], ref[i], atol=1e-4, rtol=1e-4)


def test_engine_greedy_unchanged_by_prefix_cache_and_chunks(tmp_path):
    path = save_tiny_model(tmp_path / "v32", "deepseek_v32", seed=3)
    prompts = prompts_of([45, 60, 12], seed=9)
    params = SamplingParams(max_tokens=12, **GREEDY)
    plain = LLM(str(path), progress=False, kv_cache_dtype="float32", enable_prefix_caching=False)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    chunked = LLM(str(path), progress=False, kv_cache_dtype="float32", max_num_batched_tokens=16)
    assert [r.token_ids for r in chunked.generate(prompts, params)] == expected
    # a second time: the prompts' blocks (index keys included) come from the prefix cache
    assert [r.token_ids for r in chunked.generate(prompts, params)] == expected
    assert chunked.engine.block_manager.num_free_blocks == chunked.engine.block_manager.num_blocks


def test_compressed_pools_hold_the_index_keys(tmp_path):
    """float16 and int8 pools carry [k_pe ; index key]. int8's per-channel scales bound the rotary key part by its
    own pair norms, not by the index key's (which is several times larger here), and a float16 pool gives the
    float32 pool's greedy tokens."""
    from tests.helpers.greedy import greedy_agreement

    path = save_tiny_model(tmp_path / "v32", "deepseek_v32", seed=3)
    plain = LLM(str(path), progress=False, kv_cache_dtype="float32")
    i8 = LLM(str(path), progress=False, kv_cache_dtype="int8")
    cfg = i8.engine.runner.model_cfg
    rope = cfg.qk_rope_head_dim
    for pool in i8.engine.runner.kv_caches:
        assert pool.k_scale.shape == (1, rope + cfg.index_head_dim)
        assert pool.k_scale[0, :rope].max() < pool.k_scale[0, rope:].min() / 2
    f16 = LLM(str(path), progress=False, kv_cache_dtype="float16")
    assert greedy_agreement(plain, f16, prompts_of([40, 25], seed=4), 12) == 1.0
