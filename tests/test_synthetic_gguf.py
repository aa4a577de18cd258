"""benchmarks/synthetic_gguf.py: a seeded random model in a given Qwen2 layout, written as GGUF, on a tiny
layout: the file holds every tensor of the layout at its shape (read back with the gguf package), the
tokenizer copied and padded, and sudu loads it and generates with finite log-probabilities."""
from __future__ import annotations

import math

import gguf
import numpy as np

from benchmarks.shape_vs_llama_server import bytes_per_token
from benchmarks.synthetic_gguf import Qwen2Layout, tensor_specs, write_synthetic_gguf
from sudu import LLM
from sudu.sampling import SamplingParams
from sudu.weights.gguf import config_from_gguf, open_gguf
from tests.helpers.gguf_files import write_tiny_gguf

TINY = Qwen2Layout(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=160,
                   vocab_size=320)


def _write(tmp_path, seed=0):
    source = tmp_path / "tokenizer-source.gguf"
    write_tiny_gguf(source, "qwen2")  # a 259-token byte-level vocabulary
    path = tmp_path / f"synthetic-{seed}.gguf"
    write_synthetic_gguf(str(path), TINY, str(source), seed=seed, progress=False)
    return path, gguf.GGUFReader(str(source))


def test_file_holds_the_layout_and_the_padded_tokenizer(tmp_path):
    path, source = _write(tmp_path)
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    # every tensor of a Qwen2 network with an untied head and QKV biases, no other
    assert len(tensors) == 3 + 12 * TINY.num_layers
    assert tensors["token_embd.weight"].shape.tolist()[::-1] == [320, 64]
    assert tensors["output.weight"].shape.tolist()[::-1] == [320, 64]
    assert tensors["blk.2.attn_k.weight"].shape.tolist()[::-1] == [2 * 16, 64]
    assert tensors["blk.2.attn_k.bias"].shape.tolist() == [2 * 16]
    assert tensors["blk.0.ffn_down.weight"].shape.tolist()[::-1] == [64, 160]
    for name, shape, kind in tensor_specs(TINY):
        t = tensors[name]
        assert tuple(t.shape.tolist()[::-1]) == shape, name
        values = np.asarray(t.data, np.float32)
        assert np.isfinite(values).all(), name
        if kind == "norm":
            assert (values == 1).all(), name
        else:
            # N(0, 0.02): the sample std within 5 of its standard errors
            assert abs(values.std() - 0.02) < 5 * 0.02 / math.sqrt(2 * values.size), name
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    src_tokens = source.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[:len(src_tokens)] == src_tokens
    assert len(tokens) == 320 and tokens[-1] == "[PAD319]"
    types = r.fields["tokenizer.ggml.token_type"].contents()
    assert types[len(src_tokens):] == [int(gguf.TokenType.UNUSED)] * (320 - len(src_tokens))
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.chat_template", "tokenizer.ggml.pre"):
        assert r.fields[key].contents() == source.fields[key].contents()


def test_seed_fixes_the_weights(tmp_path):
    a, _ = _write(tmp_path, seed=1)
    b = tmp_path / "again.gguf"
    write_synthetic_gguf(str(b), TINY, str(tmp_path / "tokenizer-source.gguf"), seed=1, progress=False)
    c, _ = _write(tmp_path, seed=2)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_sudu_loads_it_and_generates(tmp_path):
    path, _ = _write(tmp_path)
    config = config_from_gguf(open_gguf(path))
    assert (config.architecture, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size, config.vocab_size) == \
        ("qwen2", 64, 3, 4, 2, 16, 160, 320)
    assert config.attention_bias and not config.tie_word_embeddings
    assert config.rope_theta == 1e6 and config.rms_norm_eps == 1e-6
    out = LLM(str(path)).generate(["hello"], SamplingParams(max_tokens=6, temperature=0, logprobs=0,
                                                             ignore_eos=True))
    completion = out[0].outputs[0]
    assert len(completion.token_ids) == 6
    assert all(0 <= t < 320 for t in completion.token_ids)
    assert all(math.isfinite(lp.logprob) for lp in completion.logprobs)


def test_decode_bytes_per_token_of_the_file(tmp_path):
    # benchmarks/shape_vs_llama_server.py's limit: every tensor but the embedding, one embedding row, and
    # float16 K and V of every layer's KV heads per token of context
    path, _ = _write(tmp_path)
    weights, kv = bytes_per_token(str(path))
    sizes = {name: int(np.prod(shape)) * (2 if kind == "matrix" else 4) for name, shape, kind in tensor_specs(TINY)}
    assert weights == sum(sizes.values()) - sizes["token_embd.weight"] + 64 * 2
    assert kv == 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 2
