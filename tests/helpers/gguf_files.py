"""Tiny GGUF files written with the gguf package (llama.cpp's own writer), in the layouts llama.cpp's
converter produces, for tests of sudu's GGUF reading."""
from __future__ import annotations

import gguf
import numpy as np

from sudu.tokenizer import byte_to_unicode




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
