"""GGUF files of the MoE / MLA / Qwen3 architectures, written the way llama.cpp's converter writes them
(tensor names from the `gguf` package's own name map, experts stacked into 3D tensors, Mixtral's q/k rows
permuted, DeepSeek's kv_b_proj split into k_b / v_b, the metadata keys it sets), load into exactly the
weights and config of the same model read from its Hugging Face directory."""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from sudu.errors import SuduError
from sudu.tokenizer import byte_to_unicode
from sudu.weights import gguf as G
from sudu.weights.loader import load_checkpoint
from tests.helpers.tiny_models import VOCAB_SIZE, save_tiny_model

GGUF_ARCH = {"qwen3": gguf.MODEL_ARCH.QWEN3, "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
             "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA,
             "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2, "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter on llama-arch q/k rows: each head's halves interleaved
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_like_llama_cpp(hf_dir, path, arch: str, split_kv_b: bool = True, mtp_layers: int = 0) -> None:
    """mtp_layers: the checkpoint holds that many multi-token-prediction layers after the decoder's, which
    llama.cpp counts in block_count and names in nextn_predict_layers."""
    from safetensors import safe_open

    hf = __import__("json").loads((hf_dir / "config.json").read_text())
    with safe_open(str(hf_dir / "model.safetensors"), framework="np") as f:
        tensors = {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}
    a = GGUF_ARCH[arch]
    blocks = hf["num_hidden_layers"] + mtp_layers
    name_map = gguf.get_tensor_name_map(a, blocks)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[a])
    w.add_block_count(blocks)
    if mtp_layers:
        w.add_nextn_predict_layers(mtp_layers)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(hf["num_experts_per_tok"])
    if hf.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    if arch in ("qwen3", "qwen3moe"):
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    if arch.startswith("deepseek"):
        w.add_leading_dense_block_count(hf["first_k_dense_replace"])
        w.add_q_lora_rank(hf["q_lora_rank"])
        w.add_kv_lora_rank(hf["kv_lora_rank"])
        w.add_rope_dimension_count(hf["qk_rope_head_dim"])
        qk_head = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
        if split_kv_b:  # the MLA-aware converter's key widths
            w.add_key_length(hf["kv_lora_rank"] + hf["qk_rope_head_dim"])
            w.add_value_length(hf["kv_lora_rank"])
            w.add_key_length_mla(qk_head)
            w.add_value_length_mla(hf["v_head_dim"])
        else:
            w.add_key_length(qk_head)
            w.add_value_length(hf["v_head_dim"])
        w.add_expert_shared_count(hf["n_shared_experts"])
        w.add_expert_weights_scale(hf["routed_scaling_factor"])
        v3 = arch == "deepseek_v3"
        w.add_expert_weights_norm(bool(hf.get("norm_topk_prob", False)))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_expert_group_count(hf["n_group"])
        w.add_expert_group_used_count(hf["topk_group"])
        rope = hf["rope_parameters"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    tokens = [byte_to_unicode()[b] for b in range(256)] + [f"<|extra_{i}|>" for i in range(VOCAB_SIZE - 256)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (VOCAB_SIZE - 256))
    w.add_token_merges([])
    w.add_eos_token_id(VOCAB_SIZE - 1)

    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m:  # llama.cpp stacks each projection of all experts into one 3D tensor
            stacked.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
            continue
        if name.endswith(("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.head.weight",
                          "shared_head.norm.weight")):  # MTP-only parts: blk.N.nextn.{eh_proj, shared_head_head, ...}
            part = "_".join(name.split(".")[3:-1])
            w.add_tensor(f"blk.{name.split('.')[2]}.nextn.{part}.weight", t)
            continue
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            heads, nope, v = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["v_head_dim"]
            kv_b = t.reshape(heads, nope + v, t.shape[-1])
            for part, value in (("k_b_proj", kv_b[:, :nope].transpose(0, 2, 1)), ("v_b_proj", kv_b[:, nope:])):
                w.add_tensor(name_map.get_name(name.replace("kv_b_proj", part), try_suffixes=(".weight",)),
                             np.ascontiguousarray(value))
            continue
        if arch == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, hf["num_attention_heads"] if "q_proj" in name else hf["num_key_value_heads"])
        if name.endswith("e_score_correction_bias"):
            gname = name_map.get_name(name.removesuffix("_bias"), try_suffixes=()) + ".bias"
        else:
            gname = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, t)
    for base, parts in stacked.items():
        w.add_tensor(name_map.get_name(base + ".weight", try_suffixes=(".weight",)),
                     np.stack([parts[e] for e in sorted(parts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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

    from sudu.engine.model_runner import load_network

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
    from sudu.engine.model_runner import load_network

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
