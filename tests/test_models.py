"""Each architecture's forward pass equals the transformers reference (fp32, 1e-4), for a batch of
prompts of different lengths in one flat forward pass, and when the same tokens arrive in pieces
(cached prefix, then chunk, then single-token decodes) through the paged KV pool."""
import tempfile

import pytest
import torch

from sudu.layers.attention import build_metadata
from sudu.layers.kv_cache import KVCache
from sudu.models import build_model
from sudu.model_config import ModelConfig
from sudu.weights import safetensors as st_weights
from tests.helpers.tiny_models import build_hf_model

ARCHS = ["qwen2", "llama", "gemma3", "qwen3", "qwen2moe", "qwen3moe", "mixtral", "deepseek_v3", "deepseek_v2"]


def sudu_from_hf(hf) -> torch.nn.Module:
    """sudu's network with the reference's weights, read as a checkpoint on disk holds them (save_pretrained
    writes experts one tensor each, as published checkpoints do; in memory transformers stacks them)."""
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    model = build_model(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        state = dict(st_weights.iter_tensors(d, arch=cfg.architecture))
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=True)
    return model


def kv_pool(cfg: ModelConfig, num_slots: int):
    heads, k_dim, v_dim = cfg.kv_cache_shape()
    return [KVCache(num_slots, heads, k_dim, torch.float32, v_head_dim=v_dim) for _ in range(cfg.num_hidden_layers)]


def run_pieces(model, pieces_per_seq: list[list[list[int]]], slot_base: list[int], pool):
    """Feed each sequence its pieces step by step (all sequences together in each step); returns
    per-sequence logits of every fed token, concatenated."""
    cfg = model.config
    num_steps = max(len(p) for p in pieces_per_seq)
    done = [0] * len(pieces_per_seq)
    logits = [[] for _ in pieces_per_seq]
    for step in range(num_steps):
        ids, pos, q_lens, ctx_slots, owners = [], [], [], [], []
        for i, pieces in enumerate(pieces_per_seq):
            if step >= len(pieces):
                continue
            piece = pieces[step]
            ids += piece
            pos += list(range(done[i], done[i] + len(piece)))
            done[i] += len(piece)
            q_lens.append(len(piece))
            ctx_slots.append(torch.arange(slot_base[i], slot_base[i] + done[i]))
            owners.append(i)
        meta = build_metadata(q_lens, ctx_slots, pool, cfg.sliding_window if "sliding_attention" in cfg.layer_types else None)
        with torch.no_grad():
            out = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), meta))
        row = 0
        for i, n in zip(owners, q_lens):
            logits[i].append(out[row:row + n])
            row += n
    return [torch.cat(x) for x in logits]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch):
    hf = build_hf_model(arch, seed=1)
    model = sudu_from_hf(hf)
    g = torch.Generator().manual_seed(0)
    lengths = [1, 5, 13, 29]  # 29 > the gemma test window of 8
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).logits[0] for p in prompts]
    base = [0]
    for n in lengths[:-1]:
        base.append(base[-1] + n)

    # all prompts in one forward pass
    got = run_pieces(model, [[p] for p in prompts], base, kv_pool(model.config, sum(lengths)))
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)

    # the same tokens in pieces: a chunk, a second chunk over the cached prefix, then one-token decodes
    def split(p):
        if len(p) < 6:
            return [[t] for t in p]
        return [p[:3], p[3:len(p) - 3]] + [[t] for t in p[len(p) - 3:]]

    got = run_pieces(model, [split(p) for p in prompts], base, kv_pool(model.config, sum(lengths)))
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)


# DeepSeek-V3 at the shapes a trial reported off by 3-7e-3 in logprobs (hidden 96, grouped routing, query
# ranks 48 and 32 over a key/value rank of 32) and their neighbours that agreed. The gap was the engine's
# --kv-cache-dtype auto choosing int8 for those weights (docs/models.md); through float32 pools every shape
# must agree. "eps1e-3": a config eps far from the 1e-6 the latent norms use in DeepSeek's code and transformers.
DEEPSEEK_SHAPES = {
    "h96-q48-kv32": dict(hidden_size=96, q_lora_rank=48, kv_lora_rank=32),
    "h96-q32-kv32": dict(hidden_size=96, q_lora_rank=32, kv_lora_rank=32),
    "h96-q64-kv32": dict(hidden_size=96, q_lora_rank=64, kv_lora_rank=32),
    "h96-qnone-kv32": dict(hidden_size=96, q_lora_rank=None, kv_lora_rank=32),
    "h96-q48-kv48": dict(hidden_size=96, q_lora_rank=48, kv_lora_rank=48),
    "eps1e-3": dict(hidden_size=96, q_lora_rank=48, kv_lora_rank=32, rms_norm_eps=1e-3),
}


@pytest.mark.parametrize("shape", DEEPSEEK_SHAPES)
def test_deepseek_v3_shapes_match_transformers(shape):
    hf = build_hf_model("deepseek_v3", seed=1, **DEEPSEEK_SHAPES[shape])
    model = sudu_from_hf(hf)
    prompt = torch.randint(0, hf.config.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    pieces = [prompt[:20]] + [[t] for t in prompt[20:]]  # a prompt chunk, then every later token decoded
    for fed in ([prompt], pieces):
        got = torch.log_softmax(run_pieces(model, [fed], [0], kv_pool(model.config, 48))[0], -1)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_scattered_slots_equal_contiguous():
    """Attention reads K/V only through the slots it is given: a permuted slot layout changes nothing."""
    hf = build_hf_model("qwen2", seed=2)
    model = sudu_from_hf(hf)
    prompt = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    pool = kv_pool(model.config, 64)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(4))[:20]
    meta = build_metadata([20], [slots], pool, None)
    with torch.no_grad():
        out = model.compute_logits(model(torch.tensor(prompt), torch.arange(20), meta))
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
