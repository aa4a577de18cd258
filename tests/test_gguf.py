"""GGUF reading without a real model: dequantization of every supported type against an independent
per-block reference written from ggml's block layouts, the parser against gguf.GGUFReader, metadata ->
ModelConfig, GGUF -> Hugging Face names and conventions, and the loader on a tiny synthetic file."""
from __future__ import annotations


import gguf
import numpy as np
import pytest
import torch

from sudu.errors import SuduError
from sudu.weights import gguf as G
from sudu.weights.loader import load_checkpoint
from tests.helpers.gguf_files import write_tiny_gguf

RNG_SEED = 0


# ---- independent references: one block at a time, straight from ggml's C layouts ----

def _f16(b: np.ndarray, at: int) -> np.float32:
    return np.float32(b[at:at + 2].view(np.float16)[0])


def ref_q8_0(b):
    return _f16(b, 0) * b[2:34].view(np.int8).astype(np.float32)


def ref_q4_0(b):
    d, qs = _f16(b, 0), b[2:18].astype(np.int32)
    return np.concatenate([(qs & 0xF) - 8, (qs >> 4) - 8]).astype(np.float32) * d


def ref_q4_1(b):
    d, m, qs = _f16(b, 0), _f16(b, 2), b[4:20].astype(np.int32)
    return np.concatenate([qs & 0xF, qs >> 4]).astype(np.float32) * d + m


def _q5(qs, qh):
    y = np.zeros(32, dtype=np.int32)
    for j in range(16):
        y[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4)
        y[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
    return y


def ref_q5_0(b):
    qh = int.from_bytes(b[2:6].tobytes(), "little")
    return (_q5(b[6:22].astype(np.int32), qh) - 16).astype(np.float32) * _f16(b, 0)


def ref_q5_1(b):
    qh = int.from_bytes(b[4:8].tobytes(), "little")
    return _q5(b[8:24].astype(np.int32), qh).astype(np.float32) * _f16(b, 0) + _f16(b, 2)


def _scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_q4_k(b):
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), b[4:16].astype(np.int32), b[16:144].astype(np.int32)
    y = []
    for chunk in range(4):
        q = qs[32 * chunk:32 * chunk + 32]
        sc1, m1 = _scale_min_k4(2 * chunk, scales)
        sc2, m2 = _scale_min_k4(2 * chunk + 1, scales)
        y += [d * sc1 * (q & 0xF) - dmin * m1, d * sc2 * (q >> 4) - dmin * m2]
    return np.concatenate(y).astype(np.float32)


def ref_q5_k(b):
    d, dmin, scales = _f16(b, 0), _f16(b, 2), b[4:16].astype(np.int32)
    qh, qs = b[16:48].astype(np.int32), b[48:176].astype(np.int32)
    y = []
    for chunk in range(4):
        q = qs[32 * chunk:32 * chunk + 32]
        sc1, m1 = _scale_min_k4(2 * chunk, scales)
        sc2, m2 = _scale_min_k4(2 * chunk + 1, scales)
        hi1 = ((qh >> (2 * chunk)) & 1) << 4
        hi2 = ((qh >> (2 * chunk + 1)) & 1) << 4
        y += [d * sc1 * ((q & 0xF) + hi1) - dmin * m1, d * sc2 * ((q >> 4) + hi2) - dmin * m2]
    return np.concatenate(y).astype(np.float32)


def ref_q6_k(b):
    ql, qh = b[0:128].astype(np.int32), b[128:192].astype(np.int32)
    sc, d = b[192:208].view(np.int8).astype(np.float32), _f16(b, 208)
    y = np.zeros(256, dtype=np.float32)
    for half in range(2):
        l_, h_, s_, o = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
        for l in range(32):
            i = l // 16
            y[o + l] = d * s_[i] * (((l_[l] & 0xF) | (((h_[l] >> 0) & 3) << 4)) - 32)
            y[o + l + 32] = d * s_[i + 2] * (((l_[l + 32] & 0xF) | (((h_[l] >> 2) & 3) << 4)) - 32)
            y[o + l + 64] = d * s_[i + 4] * (((l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4)) - 32)
            y[o + l + 96] = d * s_[i + 6] * (((l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4)) - 32)
    return y


def ref_q8_k(b):
    return b[0:4].view(np.float32)[0] * b[4:260].view(np.int8).astype(np.float32)


# type -> (block bytes, elements, offsets of f16 scale fields, offset of an f32 scale, reference)
BLOCK_TYPES = {
    "Q8_0": (34, 32, [0], None, ref_q8_0),
    "Q4_0": (18, 32, [0], None, ref_q4_0),
    "Q4_1": (20, 32, [0, 2], None, ref_q4_1),
    "Q5_0": (22, 32, [0], None, ref_q5_0),
    "Q5_1": (24, 32, [0, 2], None, ref_q5_1),
    "Q4_K": (144, 256, [0, 2], None, ref_q4_k),
    "Q5_K": (176, 256, [0, 2], None, ref_q5_k),
    "Q6_K": (210, 256, [208], None, ref_q6_k),
    "Q8_K": (292, 256, [], 0, ref_q8_k),
}


def random_blocks(ggml_type: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes are valid blocks once the scale fields hold finite, modest floats."""
    size, _, f16_at, f32_at, _ = BLOCK_TYPES[ggml_type]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for at in f16_at:
        blocks[:, at:at + 2] = rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if f32_at is not None:
        blocks[:, f32_at:f32_at + 4] = rng.uniform(-0.05, 0.05, n_blocks).astype(np.float32).view(np.uint8).reshape(-1, 4)
    return blocks


@pytest.mark.parametrize("ggml_type", list(BLOCK_TYPES))
def test_dequantize_matches_reference(ggml_type):
    rng = np.random.default_rng(RNG_SEED)
    size, per_block, _, _, reference = BLOCK_TYPES[ggml_type]
    rows, blocks_per_row = 3, 4
    blocks = random_blocks(ggml_type, rows * blocks_per_row, rng)
    expected = np.stack([reference(b) for b in blocks]).reshape(rows, blocks_per_row * per_block)
    got = G.dequantize_blocks(blocks.reshape(rows, -1), ggml_type, (rows, blocks_per_row * per_block))
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, torch.from_numpy(expected), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ggml_type", [t for t in BLOCK_TYPES if t != "Q8_K"])
def test_dequantize_equals_the_gguf_package_bit_for_bit(ggml_type):
    """transformers loads GGUF files through the gguf package's dequantization: sudu's float32 weights must be
    its bits exactly, so that the two sides of test_real_forward.py compute on the same numbers."""
    blocks = random_blocks(ggml_type, 300, np.random.default_rng(RNG_SEED))
    size, per_block, *_ = BLOCK_TYPES[ggml_type]
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ggml_type]).astype(np.float32)
    got = G.dequantize_blocks(blocks.reshape(30, -1), ggml_type, (30, 10 * per_block))
    assert torch.equal(got, torch.from_numpy(expected).reshape(30, -1))


@pytest.mark.parametrize("ggml_type,np_dtype", [("F32", np.float32), ("F16", np.float16)])
def test_float_types(ggml_type, np_dtype):
    x = np.random.default_rng(RNG_SEED).standard_normal((5, 8)).astype(np_dtype)
    got = G.dequantize_blocks(x.view(np.uint8), ggml_type, (5, 8))
    assert torch.equal(got, torch.from_numpy(x.astype(np.float32)))


def test_bf16():
    x = torch.randn(4, 16).to(torch.bfloat16)
    raw = x.view(torch.uint8).numpy()
    assert torch.equal(G.dequantize_blocks(raw, "BF16", (4, 16)), x.float())


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q8_0", "Q5_0"])
def test_quantize_roundtrip_with_gguf(ggml_type):
    # gguf's quantizer on real-valued data, our dequantizer back: equal to the reference, close to the input.
    x = np.random.default_rng(RNG_SEED).standard_normal((4, 64)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    blocks = gguf.quants.quantize(x, qtype)
    got = G.dequantize_blocks(blocks, ggml_type, x.shape)
    reference = BLOCK_TYPES[ggml_type][4]
    expected = np.stack([reference(b) for b in blocks.reshape(-1, BLOCK_TYPES[ggml_type][0])]).reshape(x.shape)
    torch.testing.assert_close(got, torch.from_numpy(expected), rtol=0, atol=0)
    tolerance = {"Q8_0": 0.02, "Q5_0": 0.1, "Q4_0": 0.25}[ggml_type]
    assert float(np.abs(got.numpy() - x).max()) < tolerance * float(np.abs(x).max())


def test_unsupported_type_is_one_clear_error():
    with pytest.raises(SuduError, match="not supported"):
        G.dequantize_blocks(np.zeros((1, 66), np.uint8), "IQ2_XXS", (1, 256))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_tiny_gguf_loads_in_hf_convention(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(path, arch, tied=(arch == "gemma3"))
    ck = load_checkpoint(str(path), progress=False)
    cfg = ck.config
    assert cfg.architecture == arch and cfg.num_hidden_layers == 2 and cfg.head_dim == 16
    assert cfg.num_key_value_heads == 2 and cfg.rms_norm_eps == 1e-6
    assert cfg.tie_word_embeddings == (arch == "gemma3")
    got = dict(ck.tensors())
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], torch.from_numpy(np.asarray(value, np.float32)).reshape(got[name].shape),
                                   rtol=0, atol=1e-6, msg=name)
    q = ck.quantized("model.layers.0.mlp.gate_proj.weight")
    assert q.ggml_type == "Q5_0" and q.shape == (96, 64) and q.blocks.dtype == np.uint8
    assert not q.blocks.flags.owndata  # a view into the memory map, not a copy
    assert ck.quantized("model.norm.weight") is None
    assert dict(ck.tensors(torch.bfloat16))["model.norm.weight"].dtype == torch.bfloat16


def test_gemma3_config(tmp_path):
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gguf(path, "gemma3", tied=True)
    cfg = G.config_from_gguf(G.open_gguf(path))
    assert cfg.rope_local_base_freq == 10000.0 and cfg.query_pre_attn_scalar == 16
    assert cfg.sliding_window == 128 and cfg.hidden_act == "gelu_pytorch_tanh"
    twelve = [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(2)]
    assert cfg.layer_types == twelve


def test_parser_matches_gguf_reader(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2")
    mine = G.open_gguf(path)
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, float):
            assert mine.metadata[key] == pytest.approx(value)
        else:
            assert mine.metadata[key] == value, key
    assert [t.name for t in mine.tensors] == [t.name for t in reader.tensors]
    for t, m in zip(reader.tensors, mine.tensors):
        assert m.ggml_type == t.tensor_type.name and m.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(m.data.reshape(-1), t.data.reshape(-1).view(np.uint8))


def test_truncated_gguf_is_one_clear_error(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2")
    data = path.read_bytes()
    for cut in (len(data) - 100, 2000, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(SuduError) as info:
            G.open_gguf(bad)
        message = str(info.value)
        assert "truncated or corrupt" in message and "\n" not in message


def test_hf_names():
    assert G.hf_name("blk.3.ffn_norm.weight", "qwen2") == "model.layers.3.post_attention_layernorm.weight"
    assert G.hf_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert G.hf_name("blk.0.attn_q.bias", "qwen2") == "model.layers.0.self_attn.q_proj.bias"
    assert G.hf_name("output.weight", "llama") == "lm_head.weight"
    assert G.hf_name("rope_freqs.weight", "llama") is None


def test_tokenizer_from_sudus_parse_or_gguf_reader(tmp_path):
    from sudu.tokenizer import Tokenizer

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2")
    by_path, by_reader = Tokenizer.from_gguf(gguf.GGUFReader(path)), Tokenizer.from_gguf(G.open_gguf(path))
    with pytest.raises(TypeError, match="open_gguf"):
        Tokenizer.from_gguf(path)
    text = "<|im_start|>hi 你好<|im_end|>"
    assert by_path.encode(text) == by_reader.encode(text) and by_path.eos_token_ids == by_reader.eos_token_ids
    assert by_path.chat_template == by_reader.chat_template is not None


def _write_hf_dir(root, sharded: bool) -> dict[str, torch.Tensor]:
    import json

    from safetensors.torch import save_file

    from sudu.tokenizer import Tokenizer

    tiny = root / "tiny.gguf"
    write_tiny_gguf(tiny, "qwen2")
    hf = root / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_text(Tokenizer.from_gguf(G.open_gguf(tiny)).backend.to_str())
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": "{{ messages[0]['content'] }}"}))
    (hf / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 259, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "eos_token_id": 258, "sliding_window": 4096}))
    tensors = {"model.embed_tokens.weight": torch.randn(259, 8, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}
    if sharded:
        save_file({"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]}, str(hf / "model-00001-of-00002.safetensors"))
        save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(hf / "model-00002-of-00002.safetensors"))
        (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    else:
        save_file(tensors, str(hf / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_directory_checkpoint(tmp_path, sharded):
    expected = _write_hf_dir(tmp_path, sharded)
    ck = load_checkpoint(str(tmp_path / "hf"), progress=False)
    assert ck.format == "safetensors" and ck.config.architecture == "qwen2" and ck.config.attention_bias
    assert ck.config.eos_token_id[0] == 258 and ck.tokenizer.eos_token_ids[0] == 258
    got = dict(ck.tensors())
    assert set(got) == set(expected) and set(ck.tensor_names()) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value.float())
    assert ck.quantized("model.embed_tokens.weight") is None
    assert ck.tokenizer.encode("hi") == [ord("h"), ord("i")]


def test_hf_directory_with_missing_shard_is_one_clear_error(tmp_path):
    _write_hf_dir(tmp_path, sharded=True)
    (tmp_path / "hf" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SuduError, match="missing: model-00002-of-00002.safetensors"):
        load_checkpoint(str(tmp_path / "hf"), progress=False).state_dict()
