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


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config(arch: str, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

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
        # random init leaves norms at identity; perturb them so the norm convention is really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_tiny_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    model = build_hf_model(arch, seed, **overrides)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
