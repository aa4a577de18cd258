"""Multi-head latent attention: KV bytes per token and decode speed at a long context (issue: MoE, MLA, MTP).

1. KV bytes per token for DeepSeek-V3 and DeepSeek-V2-Lite shapes (from their published config.json values),
   as sudu's pool holds them (latent + rotary key per token and layer) next to full per-head K/V.
2. Decode tok/s at --context tokens on two random float32 models of the same hidden size, layers, heads and
   MLP: a DeepSeek-V2-Lite-like attention (kv_lora_rank 512, rope 64, nope 128, v 128) with latent KV, and a
   llama with full K/V (head_dim 128, as many KV heads as heads) -- the layout the same heads would need
   without the latent. Random weights: the text is meaningless; the bytes and times are what count.

    flock /tmp/sudu-bench.lock python -m benchmarks.mla_kv [--context 4096] [--tokens 32]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from sudu.engine.model_runner import kv_bytes_per_token
from sudu.model_config import ModelConfig
from sudu.sampling import SamplingParams

# name: (layers, heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
SHAPES = {"DeepSeek-V3": (61, 128, 512, 64, 128, 128), "DeepSeek-V2-Lite": (27, 16, 512, 64, 128, 128)}


def kv_table() -> None:
    print(f"{'model':18} {'KV':5} {'latent B/token':>15} {'full K/V B/token':>17} {'ratio':>6}")
    for name, (layers, heads, lora, rope, nope, v) in SHAPES.items():
        cfg = ModelConfig(architecture="deepseek2", vocab_size=1, hidden_size=1, intermediate_size=1,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                          kv_lora_rank=lora, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v)
        for kind, value_bytes in (("bf16", 2), ("int8", 1)):
            latent = kv_bytes_per_token(cfg, torch.bfloat16, "int8" if kind == "int8" else "auto")
            full = layers * heads * (nope + rope + v) * value_bytes
            print(f"{name:18} {kind:5} {latent:>15,} {full:>17,} {full / latent:>5.1f}x")


def save_random(path: Path, kind: str, layers: int) -> Path:
    from transformers import AutoModelForCausalLM, DeepseekV2Config, LlamaConfig

    from tests.helpers.tiny_models import build_tokenizer

    common = dict(vocab_size=384, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                  num_attention_heads=16, max_position_embeddings=8192, rms_norm_eps=1e-6)
    if kind == "mla":
        cfg = DeepseekV2Config(num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                               qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=layers,
                               n_routed_experts=1, **common)
    else:
        cfg = LlamaConfig(num_key_value_heads=16, head_dim=128, **common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def decode_speed(context: int, tokens: int, layers: int) -> None:
    from sudu.engine.llm import LLM

    with tempfile.TemporaryDirectory() as d:
        for kind in ("mla", "full"):
            llm = LLM(str(save_random(Path(d) / kind, kind, layers)), progress=False, num_threads=2,
                      max_model_len=context + tokens + 16)
            prompt = torch.randint(0, 380, (context,), generator=torch.Generator().manual_seed(1)).tolist()
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            llm.generate([prompt[:64]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
            t0 = time.perf_counter()
            r = llm.generate([prompt], params)[0]
            m = r.metrics
            tok_s = (len(r.token_ids) - 1) / (m.finished_time - m.first_token_time)
            kv = llm.engine.runner.kv_bytes_per_token()
            print(f"{kind:5} attention: KV {kv:,} B/token ({kv * context / 2**20:.0f} MiB at {context} tokens), "
                  f"decode {tok_s:.1f} tok/s at {context} context (wall {time.perf_counter() - t0:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--no-decode", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    kv_table()
    if not args.no_decode:
        decode_speed(args.context, args.tokens, args.layers)


if __name__ == "__main__":
    main()
