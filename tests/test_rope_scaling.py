"""RoPE scaling (layers/rotary.py, model_config.py): YaRN, linear and Llama 3 positions against transformers'
own rotary embeddings up to 128k positions, --rope-scaling replacing a model's scaling and extending its
context, and a tiny model served past its original context with YaRN giving transformers' greedy tokens."""
from __future__ import annotations

import json

import pytest
import torch

from sudu.config import EngineConfig
from sudu.engine.llm import LLM
from sudu.layers.rotary import scaled_rotary
from sudu.model_config import ModelConfig, with_rope_scaling
from sudu.sampling import SamplingParams
from tests.helpers.greedy import GREEDY, prompts_of, reference_greedy
from tests.helpers.tiny_models import build_hf_model, save_tiny_model

POSITIONS = torch.tensor([0, 1, 7, 1000, 4095, 32767, 32768, 65537, 100000, 131071])
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1000000.0}


def reference_cos_sin(hf_cfg):
    """transformers' own rotary embedding of the model family, at POSITIONS."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    rotary = (Qwen2RotaryEmbedding if hf_cfg.model_type == "qwen2" else LlamaRotaryEmbedding)(hf_cfg)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), POSITIONS[None])
    return cos[0], sin[0]


def check_positions(hf_cfg, atol: float):
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    cos, sin = scaled_rotary(cfg).lookup(POSITIONS, torch.float32)
    ref_cos, ref_sin = reference_cos_sin(hf_cfg)
    # float32 angles of 1e5 radians: the last bits of one frequency differ by a few ulps between the two
    # ways of forming it, which moves the angle by ~1e-3 rad at the far positions; a wrong scaling moves it by ~1
    torch.testing.assert_close(cos, ref_cos, atol=atol, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=atol, rtol=0)
    return cfg


@pytest.mark.parametrize("head_dim", [64, 128])
def test_yarn_positions_match_transformers_to_128k(head_dim):
    from transformers import Qwen2Config

    hf_cfg = Qwen2Config(hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                         num_hidden_layers=1, intermediate_size=64, vocab_size=32, max_position_embeddings=32768,
                         rope_parameters=dict(QWEN_YARN))
    cfg = check_positions(hf_cfg, atol=2e-3)
    assert cfg.max_position_embeddings == 131072  # YaRN's context: original x factor
    cos0, _ = scaled_rotary(cfg).lookup(torch.tensor([0]), torch.float32)
    assert cos0[0, 0].item() == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)  # attention factor
    # the scaling matters at these positions: without it the tables differ by far more than the tolerance
    plain, _ = scaled_rotary(with_rope_scaling(cfg, {"type": "default"})).lookup(POSITIONS, torch.float32)
    assert (plain - reference_cos_sin(hf_cfg)[0]).abs().max() > 0.5


def test_linear_and_llama3_positions_match_transformers():
    from transformers import LlamaConfig

    common = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=1,
                  intermediate_size=64, vocab_size=32, max_position_embeddings=131072)
    check_positions(LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                **common), atol=2e-3)
    check_positions(LlamaConfig(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                                 "rope_theta": 500000.0}, **common), atol=2e-3)


def test_rope_scaling_flag_checks_and_extends_the_context():
    cfg = ModelConfig(architecture="qwen2", vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768)
    yarn = with_rope_scaling(cfg, {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32768})
    assert yarn.max_position_embeddings == 131072 and yarn.rope_yarn["factor"] == 4.0
    assert with_rope_scaling(cfg, {"type": "linear", "factor": 2}).max_position_embeddings == 65536
    for bad, why in (('{"type": "dynamic", "factor": 2}', "length"), ('{"type": "yarn", "factor": 4}', "original_max"),
                     ('{"type": "longrope"}', "not supported"), ('[1]', "JSON object"), ("yarn", "JSON object"),
                     ('{"type": "linear", "factor": 0}', "factor > 0")):
        with pytest.raises(ValueError, match=why):
            EngineConfig(rope_scaling=bad).validate()


def test_yarn_flag_serves_past_the_original_context_like_transformers(tmp_path):
    """A tiny model trained (so its config says) for 128 positions, served with --rope-scaling YaRN x8: the
    engine's context is 1024, and greedy tokens after a 600-token prompt equal transformers' with the same
    YaRN in its config."""
    path = save_tiny_model(tmp_path / "q", "qwen2", seed=5, max_position_embeddings=128)
    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128}
    llm = LLM(str(path), progress=False, kv_cache_dtype="float32", rope_scaling=json.dumps(scaling))
    assert llm.engine.max_model_len == 1024
    hf = build_hf_model("qwen2", seed=5, max_position_embeddings=1024,
                        rope_parameters={**scaling, "rope_theta": 1000000.0})
    prompt = prompts_of([600], seed=3)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    assert out == reference_greedy(hf, prompt, 8)
    plain = LLM(str(path), progress=False, kv_cache_dtype="float32")
    assert plain.engine.max_model_len == 128


def test_gguf_yarn_metadata_is_read():
    """llama.cpp's rope.scaling keys on a qwen2 file: YaRN over the original context, the context extended."""
    from pathlib import Path

    import numpy as np

    from sudu.weights.gguf import GGUFFile, GGUFTensorInfo, config_from_gguf

    meta = {"general.architecture": "qwen2", "qwen2.embedding_length": 64, "qwen2.attention.head_count": 4,
            "qwen2.attention.head_count_kv": 2, "qwen2.block_count": 1, "qwen2.feed_forward_length": 128,
            "qwen2.context_length": 32768, "qwen2.rope.freq_base": 1000000.0, "qwen2.rope.scaling.type": "yarn",
            "qwen2.rope.scaling.factor": 4.0, "qwen2.rope.scaling.original_context_length": 32768}
    embed = GGUFTensorInfo("token_embd.weight", "F32", (32, 64), np.zeros(0, dtype=np.uint8))
    cfg = config_from_gguf(GGUFFile(Path("m.gguf"), meta, [embed]))
    assert cfg.rope_yarn == {"factor": 4.0, "original_max_position_embeddings": 32768}
    assert cfg.max_position_embeddings == 131072
