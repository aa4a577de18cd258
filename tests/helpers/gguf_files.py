"""Tiny GGUF files written with the gguf package (llama.cpp's own writer), in the layouts llama.cpp's
converter produces, for tests of sudu's GGUF reading."""
from __future__ import annotations

import json
import re

import gguf
import numpy as np
from safetensors import safe_open

from sudu.tokenizer import byte_to_unicode
from tests.helpers.tiny_models import VOCAB_SIZE


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's converter does to llama q/k weights (written from its documented behaviour).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch: str, tied: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer model with a byte-level tokenizer; returns the HF-convention float32 weights it encodes."""
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, head_dim, ffn, layers = 64, 4, 2, 16, 96, 2
    vocab_tokens = [gguf_byte(b) for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(vocab_tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(128)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab_tokens)
    w.add_token_types([1] * 256 + [3, 3, 3])
    w.add_token_merges([])
    w.add_eos_token_id(vocab - 1)
    w.add_bos_token_id(vocab - 3)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name, hf, value, quant=None, stored=None):
        expected[hf] = value.astype(np.float32)
        data = value if stored is None else stored
        if quant is None:
            w.add_tensor(gguf_name, data.astype(np.float32))
        else:
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(gguf_name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
            # what the file really holds is the quantized value
            expected[hf] = gguf.quants.dequantize(gguf.quants.quantize(value.astype(np.float32), qtype), qtype)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    norm_offset = 1.0 if arch == "gemma3" else 0.0  # llama.cpp stores gemma norms as 1 + w
    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, hidden), "Q8_0")
    norm = rand(hidden)
    add("output_norm.weight", "model.norm.weight", norm, stored=norm + norm_offset)
    if not tied:
        add("output.weight", "lm_head.weight", rand(vocab, hidden), "Q8_0")
    for i in range(layers):
        p = f"blk.{i}."
        h = f"model.layers.{i}."
        q, k = rand(heads * head_dim, hidden), rand(kv_heads * head_dim, hidden)
        q_stored = _llama_cpp_permute(q, heads) if arch == "llama" else q
        k_stored = _llama_cpp_permute(k, kv_heads) if arch == "llama" else k
        add(p + "attn_q.weight", h + "self_attn.q_proj.weight", q, stored=q_stored)
        add(p + "attn_k.weight", h + "self_attn.k_proj.weight", k, stored=k_stored)
        add(p + "attn_v.weight", h + "self_attn.v_proj.weight", rand(kv_heads * head_dim, hidden), "Q8_0")
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", rand(hidden, heads * head_dim), "Q4_0")
        if arch == "qwen2":
            for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                add(p + f"attn_{name}.bias", h + f"self_attn.{name}_proj.bias", rand(n * head_dim))
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", rand(ffn, hidden), "Q5_0")
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", rand(ffn, hidden), "Q5_0")
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", rand(hidden, ffn), "Q8_0")
        norms = {"attn_norm": "input_layernorm"}
        if arch == "gemma3":
            norms.update(post_attention_norm="post_attention_layernorm", ffn_norm="pre_feedforward_layernorm",
                         post_ffw_norm="post_feedforward_layernorm", attn_q_norm="self_attn.q_norm",
                         attn_k_norm="self_attn.k_norm")
        else:
            norms["ffn_norm"] = "post_attention_layernorm"
        for gname, hname in norms.items():
            size = head_dim if gname in ("attn_q_norm", "attn_k_norm") else hidden
            value = rand(size)
            add(p + gname + ".weight", h + hname + ".weight", value, stored=value + norm_offset)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def gguf_byte(b: int) -> str:
    return byte_to_unicode()[b]


GGUF_ARCH = {"qwen3": gguf.MODEL_ARCH.QWEN3, "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
             "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA,
             "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2, "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2}


_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$")


def write_gguf_like_llama_cpp(hf_dir, path, arch: str, split_kv_b: bool = True, mtp_layers: int = 0) -> None:
    """mtp_layers: the checkpoint holds that many multi-token-prediction layers after the decoder's, which
    llama.cpp counts in block_count and names in nextn_predict_layers."""
    hf = json.loads((hf_dir / "config.json").read_text())
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
            t = _llama_cpp_permute(t, hf["num_attention_heads"] if "q_proj" in name else hf["num_key_value_heads"])
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
