"""`--speculative mtp`: drafting with a DeepSeek-V3 checkpoint's multi-token-prediction layer.

The tiny checkpoint is a 4-layer random DeepSeek-V3 whose last layer is declared its MTP layer (config:
3 decoder layers, num_nextn_predict_layers 1) plus the MTP-only parts (enorm, hnorm, eh_proj, shared
head). Proof: every draft's logits equal an independent reference built from transformers' own decoder
layer; greedy output is identical to plain decoding at batch 1 and 4 (safetensors and GGUF); sampled
output keeps the target distribution; a checkpoint without MTP layers is refused in one line.
"""
import json
import random

import pytest
import torch

from sudu.engine.llm import LLM
from sudu.errors import SuduError
from sudu.sampling import SamplingParams
from tests.helpers.speculative import assert_second_token_keeps_the_target_distribution
from tests.helpers.tiny_models import save_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path_factory.mktemp("mtp") / "dsv3-mtp", "deepseek_v3", seed=11, num_hidden_layers=4)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(num_hidden_layers=3, num_nextn_predict_layers=1)
    cfg_file.write_text(json.dumps(cfg))
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(12)
    h = cfg["hidden_size"]
    tensors.update({
        "model.layers.3.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "model.layers.3.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "model.layers.3.eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
        "model.layers.3.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        # V3 checkpoints repeat the head inside the MTP layer; the embedding is left to the target's here
        "model.layers.3.shared_head.head.weight": tensors["lm_head.weight"].clone(),
    })
    save_file(tensors, str(file))
    return path


def reference_mtp(path):
    """(tokens, drafted) -> logits of the next draft: the target's hidden states from transformers' 3-layer
    model, the MTP layer from transformers' decoder layer 3 of the same checkpoint read as 4 layers, and
    the MTP-only parts written out here."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    cfg4 = AutoConfig.from_pretrained(path)
    cfg4.num_hidden_layers = 4
    big = AutoModelForCausalLM.from_pretrained(path, config=cfg4, attn_implementation="eager").float().eval()
    layer, rotary = big.model.layers[3], big.model.rotary_emb
    w = {k[len("model.layers.3."):]: v.float() for k, v in load_file(str(path / "model.safetensors")).items()
         if k.startswith("model.layers.3.")}
    eps = cfg4.rms_norm_eps

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    @torch.no_grad()
    def mtp_out(tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Rows j: (token tokens[j], hidden[j]) at position j -> the layer's output rows."""
        T = len(tokens)
        pos = torch.arange(T)[None]
        e = rms(target.model.embed_tokens(torch.tensor(tokens)), w["enorm.weight"])
        e[0] = 0.0
        x = torch.cat([e, rms(hidden, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rotary(x[None], pos))
        return (out[0] if isinstance(out, tuple) else out)[0]

    @torch.no_grad()
    def next_logits(tokens: list[int], drafted: list[int]) -> torch.Tensor:
        h = target.model(torch.tensor([tokens])).last_hidden_state[0]  # after the final norm
        rows_tok, rows_h = list(tokens[1:]), h[:-1]
        out = mtp_out(rows_tok, rows_h)
        for d in drafted:  # a chained draft reads the layer's own previous output
            rows_tok.append(d)
            rows_h = torch.cat([rows_h, out[-1:]])
            out = mtp_out(rows_tok, rows_h)
        return rms(out[-1], w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T

    return next_logits


def prompts(n, seed):
    g = random.Random(seed)
    return [[g.randrange(380) for _ in range(g.randrange(3, 30))] for _ in range(n)]


def test_every_draft_matches_a_reference_mtp_layer(mtp_dir):
    llm = LLM(str(mtp_dir), progress=False, quantization="none", speculative="mtp", num_speculative_tokens=3,
              max_num_batched_tokens=24)  # 24: a 29-token prompt's catch-up comes in two chunks
    drafter = llm.engine.speculator.drafter
    seen = []
    pick = drafter._pick

    def spy(seq, logits, drafted, probs):
        seen.append((list(seq.token_ids), list(drafted), logits.clone()))
        return pick(seq, logits, drafted, probs)

    drafter._pick = spy
    llm.generate(prompts(3, 1), SamplingParams(max_tokens=12, **GREEDY))
    reference = reference_mtp(mtp_dir)
    assert len(seen) > 20 and any(d for _, d, _ in seen)  # first and chained drafts
    for tokens, drafted, logits in seen:
        want = reference(tokens, drafted)
        assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4), (len(tokens), drafted, (logits - want).abs().max())


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identical_with_mtp(mtp_dir, batch):
    plain = LLM(str(mtp_dir), progress=False, quantization="none")
    spec = LLM(str(mtp_dir), progress=False, quantization="none", speculative="mtp")
    ps = prompts(batch, 2 + batch)
    params = SamplingParams(max_tokens=24, **GREEDY)
    want = [r.token_ids for r in plain.generate(ps, params)]
    got = [r.token_ids for r in spec.generate(ps, params)]
    assert got == want
    assert spec.engine.speculator.num_draft_tokens > 0


def test_greedy_identical_with_mtp_from_gguf(mtp_dir, tmp_path):
    from tests.helpers.gguf_files import write_gguf_like_llama_cpp

    write_gguf_like_llama_cpp(mtp_dir, tmp_path / "m.gguf", "deepseek_v3", mtp_layers=1)
    gguf, hf = (LLM(str(p), progress=False, quantization="none", speculative="mtp") for p in (tmp_path / "m.gguf", mtp_dir))
    ps = prompts(3, 7)
    params = SamplingParams(max_tokens=16, **GREEDY)
    assert [r.token_ids for r in gguf.generate(ps, params)] == [r.token_ids for r in hf.generate(ps, params)]
    assert gguf.engine.speculator.num_accepted_tokens == hf.engine.speculator.num_accepted_tokens


def test_mtp_sampling_keeps_the_target_distribution(mtp_dir):
    """The second generated token's distribution with MTP drafts equals the exact marginal computed from the
    target's own logits (6,000 samples)."""
    plain = LLM(str(mtp_dir), progress=False, quantization="none")
    spec = LLM(str(mtp_dir), progress=False, quantization="none", speculative="mtp", speculative_max_batch=100000,
               max_num_seqs=256, max_num_batched_tokens=100000)
    assert_second_token_keeps_the_target_distribution(plain, spec, prompts(1, 9)[0][:4], 6000)


def test_a_checkpoint_without_mtp_layers_is_refused_in_one_line(tmp_path):
    path = save_tiny_model(tmp_path / "plain", "deepseek_v3", seed=3)
    with pytest.raises(SuduError, match="multi-token-prediction") as info:
        LLM(str(path), progress=False, quantization="none", speculative="mtp")
    assert "\n" not in str(info.value)
