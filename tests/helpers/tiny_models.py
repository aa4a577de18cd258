"""Tiny randomly initialised models for tests, built with transformers (the reference) and saved as
Hugging Face-style directories (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)."""
from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "你好，世界！ 速度 sudu 🚀✨ café naïve",
    "SELECT name, count(*) FROM users GROUP BY name;",
    "import asyncio\nasync def main():\n    await asyncio.sleep(0)\n",
]
VOCAB_SIZE = 384


def build_tokenizer(special_tokens: list[str] | None = None):
    """A byte-level BPE tokenizer of VOCAB_SIZE ids trained on CORPUS, with the special tokens last (the
    vision models' tiny tokenizers add their image tokens to SPECIAL_TOKENS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = SPECIAL_TOKENS if special_tokens is None else special_tokens
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_special_tokens(special_tokens)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config(arch: str, **overrides):
    from transformers import (DeepseekV2Config, DeepseekV3Config, DeepseekV32Config, Gemma3TextConfig, LlamaConfig,
                              MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        cfg = Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1000000.0, **common)
    elif arch == "llama":
        cfg = LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False, rope_theta=10000.0, **common)
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(
            num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            **common,
        )
    elif arch == "qwen3":
        cfg = Qwen3Config(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1000000.0, **common)
    elif arch == "qwen2moe":  # layer 1 dense (mlp_only_layers), the others routed with a gated shared expert
        cfg = Qwen2MoeConfig(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64, mlp_only_layers=[1], tie_word_embeddings=False,
                             **common)
    elif arch == "qwen3moe":
        cfg = Qwen3MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                             norm_topk_prob=True, **common)
    elif arch == "mixtral":
        cfg = MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **common)
    elif arch in ("deepseek_v3", "deepseek_v2", "deepseek_v32"):
        # MLA (q and kv low-rank, decoupled rope dims), YaRN, first layer dense, then routed + shared experts;
        # V3: sigmoid scores, correction bias, 4 groups of 4 with 2 eligible
        mla = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_hidden_layers=3,
                   first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                   n_group=4, topk_group=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                                    "mscale": 0.8, "mscale_all_dim": 0.8})
        if arch == "deepseek_v3":
            cfg = DeepseekV3Config(routed_scaling_factor=2.5, norm_topk_prob=True, **mla)
        elif arch == "deepseek_v32":  # V3 + DeepSeek Sparse Attention: 4 index heads of 16, each query's 8 best
            cfg = DeepseekV32Config(routed_scaling_factor=2.5, norm_topk_prob=True, index_n_heads=4, index_head_dim=16,
                                    index_topk=8, **mla)
        else:  # mscale != mscale_all_dim: YaRN's attention factor scales cos/sin too
            mla["rope_parameters"]["mscale"] = 1.0
            cfg = DeepseekV2Config(routed_scaling_factor=1.5, topk_method="group_limited_greedy", **mla)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg.eos_token_id = SPECIAL_TOKENS.index("<|im_end|>") + VOCAB_SIZE - len(SPECIAL_TOKENS)
    return cfg


def build_hf_model(arch: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        # random init leaves norms at identity and routers/biases at zero; perturb them so the norm
        # convention and the routing are really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def save_tiny_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    model = build_hf_model(arch, seed, **overrides)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
