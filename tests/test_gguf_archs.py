"""GGUF files of the MoE / MLA / Qwen3 architectures, written the way llama.cpp's converter writes them
(tensor names from the `gguf` package's own name map, experts stacked into 3D tensors, Mixtral's q/k rows
permuted, DeepSeek's kv_b_proj split into k_b / v_b, the metadata keys it sets), load into exactly the
weights and config of the same model read from its Hugging Face directory."""
from __future__ import annotations


import gguf
import numpy as np
import pytest
import torch

from sudu.errors import SuduError
from sudu.weights import gguf as G
from sudu.weights.loader import load_checkpoint
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.gguf_files import write_gguf_like_llama_cpp

ARCHS = ["qwen3", "qwen2moe", "qwen3moe", "mixtral", "deepseek_v3", "deepseek_v2"]
# llama.cpp's qwen2moe has no dense layers (no mlp_only_layers)
OVERRIDES = {"qwen2moe": {"mlp_only_layers": []}}


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_matches_safetensors(tmp_path, arch):
    hf_dir = save_tiny_model(tmp_path / "hf", arch, seed=3, **OVERRIDES.get(arch, {}))
    write_gguf_like_llama_cpp(hf_dir, tmp_path / "m.gguf", arch)
    ref, got = load_checkpoint(str(hf_dir), progress=False), load_checkpoint(str(tmp_path / "m.gguf"), progress=False)
    skip = {"eos_token_id", "bos_token_id", "max_position_embeddings", "rope_yarn", "num_nextn_predict_layers"}
    for field, value in vars(ref.config).items():
        if field not in skip:
            assert getattr(got.config, field) == value, field
    expected, loaded = ref.state_dict(), got.state_dict()
    if ref.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    if arch.startswith("deepseek"):  # llama.cpp keeps only factor, original length and the log multiplier
        yarn = {k: ref.config.rope_yarn[k] for k in ("factor", "original_max_position_embeddings", "mscale_all_dim")}
        assert {k: got.config.rope_yarn[k] for k in yarn} == pytest.approx(yarn)


def test_deepseek_gguf_with_whole_kv_b(tmp_path):
    """Files from before llama.cpp's MLA-aware converter store kv_b_proj whole."""
    hf_dir = save_tiny_model(tmp_path / "hf", "deepseek_v3", seed=3)
    write_gguf_like_llama_cpp(hf_dir, tmp_path / "m.gguf", "deepseek_v3", split_kv_b=False)
    ref, got = load_checkpoint(str(hf_dir), progress=False), load_checkpoint(str(tmp_path / "m.gguf"), progress=False)
    assert got.config.qk_nope_head_dim == ref.config.qk_nope_head_dim
    assert got.config.v_head_dim == ref.config.v_head_dim
    loaded = got.state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(loaded[name], value), name


def test_deepseek_mtp_layers_are_left_out(tmp_path):
    """A V3 checkpoint's multi-token-prediction layer (model.layers.{num_hidden_layers}; GGUF: counted in
    block_count, named by nextn_predict_layers) is not part of the network and does not break loading."""
    from safetensors.torch import load_file, save_file

    from sudu.engine.network import load_network

    hf_dir = save_tiny_model(tmp_path / "hf", "deepseek_v3", seed=3)
    file = hf_dir / "model.safetensors"
    tensors = load_file(str(file))
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    mtp.update({"model.layers.3.enorm.weight": torch.ones(64), "model.layers.3.hnorm.weight": torch.ones(64),
                "model.layers.3.eh_proj.weight": torch.zeros(64, 128)})
    save_file({**tensors, **mtp}, str(file))
    write_gguf_like_llama_cpp(hf_dir, tmp_path / "m.gguf", "deepseek_v3", mtp_layers=1)
    for source in (hf_dir, tmp_path / "m.gguf"):
        ck = load_checkpoint(str(source), progress=False)
        assert ck.config.num_hidden_layers == 3
        assert not any(n.startswith("model.layers.3.") for n in ck.tensor_names())
        load_network(ck.config, ck.tensors(), torch.float32)


def test_unknown_architecture_and_missing_tensors_are_one_line(tmp_path):
    from sudu.engine.network import load_network

    hf_dir = save_tiny_model(tmp_path / "hf", "qwen3moe", seed=3)
    write_gguf_like_llama_cpp(hf_dir, tmp_path / "m.gguf", "qwen3moe")
    ck = load_checkpoint(str(tmp_path / "m.gguf"), progress=False)
    tensors = [(n, t) for n, t in ck.tensors() if "experts.5." not in n]
    with pytest.raises(SuduError) as info:
        load_network(ck.config, tensors, torch.float32)
    assert "missing" in str(info.value) and "experts.5" in str(info.value) and "\n" not in str(info.value)

    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SuduError, match="unsupported GGUF architecture 'mamba'") as info:
        G.config_from_gguf(G.open_gguf(tmp_path / "odd.gguf"))
    assert "\n" not in str(info.value)
