"""A synthetic mixture of experts from the catalog's qwen2.5-coder-0.5b-instruct (issue: MoE, MLA, MTP).

No MoE checkpoint can be downloaded here, so the dense model is cut into one: each layer's FFN (4864 columns)
becomes 8 experts of 608 columns (expert e: gate/up rows and down columns e*608..e*608+607), written as a
qwen2_moe directory (float32 safetensors, the GGUF's dequantized weights, tokenizer.json from the GGUF).

- exact: the router weight is zero, so softmax gives each expert 1/8, and routed_scaling_factor = 8 (a
  sudu ModelConfig field; transformers' Qwen2-MoE has no such knob) makes every gate exactly 1. With all 8
  selected, the MoE computes the dense FFN as a sum of 8 column blocks (int8 groups of 32 columns line up
  with the 608-column blocks), so it differs from the dense model only in summation order; the greedy
  outputs of both engines (int8) are compared. tests/test_moe_real.py checks the float32 logits.
- top2: a fixed router (seeded N(0, 1) rows, scaled by 1/sqrt(hidden)) picks 2 of 8; the text it writes
  is meaningless, the point is the bytes: decode tok/s at batch 1 next to the roofline from the bytes a
  step actually reads (attention, 2 experts per layer, router, head, one embedding row), and at batch 8
  the tok/s next to the bytes of the union of experts the batch touched (counted per step by hooks).

    flock /tmp/sudu-bench.lock python -m benchmarks.moe_synthetic [--parts exact,top2] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from sudu.layers.linear import GROUP_SIZE
from sudu.roofline import measure_bandwidth_gbs
from sudu.sampling import SamplingParams

DENSE = "qwen2.5-coder-0.5b-instruct"
NUM_EXPERTS = 8
PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain what a hash table is in two sentences.",
           "def quicksort(items):"]
INT8_BYTES_PER_WEIGHT = 1.0 + 2.0 / GROUP_SIZE


def moe_tensors(named_tensors, c, router_seed: int | None):
    """(name, tensor) of the dense checkpoint (its tensors, its ModelConfig c) cut into NUM_EXPERTS experts
    per layer; router zero (exact) or seeded random rows scaled by 1/sqrt(hidden)."""
    width = c.intermediate_size // NUM_EXPERTS
    gen = torch.Generator().manual_seed(router_seed or 0)
    for name, t in named_tensors:
        prefix, sep, leaf = name.rpartition(".mlp.")
        if not sep:
            yield name, t
            continue
        part = leaf.split(".")[0]
        for e in range(NUM_EXPERTS):
            cols = slice(e * width, (e + 1) * width)
            yield f"{prefix}.mlp.experts.{e}.{leaf}", (t[:, cols] if part == "down_proj" else t[cols]).contiguous()
        if part == "gate_proj":
            router = torch.zeros(NUM_EXPERTS, c.hidden_size)
            if router_seed is not None:
                router = torch.randn(NUM_EXPERTS, c.hidden_size, generator=gen) / math.sqrt(c.hidden_size)
            yield f"{prefix}.mlp.gate.weight", router


def moe_config(ckpt, top_k: int, router_seed: int | None) -> dict:
    """The synthetic model's config.json."""
    c = ckpt.config
    return {"model_type": "qwen2_moe", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "moe_intermediate_size": c.intermediate_size // NUM_EXPERTS,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings, "num_experts": NUM_EXPERTS,
            "num_experts_per_tok": top_k, "norm_topk_prob": False, "shared_expert_intermediate_size": 0,
            "routed_scaling_factor": float(NUM_EXPERTS) if router_seed is None else 1.0,
            "eos_token_id": c.eos_token_id, "bos_token_id": c.bos_token_id}


def build_moe_dir(out: Path, top_k: int, router_seed: int | None) -> Path:
    """The synthetic model as a Hugging Face-style directory (float32 safetensors, tokenizer from the GGUF)."""
    from safetensors.torch import save_file

    from sudu.weights.loader import load_checkpoint

    ckpt = load_checkpoint(DENSE, progress=False)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(moe_tensors(ckpt.tensors(torch.float32), ckpt.config, router_seed)), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(moe_config(ckpt, top_k, router_seed)))
    (out / "tokenizer.json").write_text(ckpt.tokenizer.backend.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": ckpt.tokenizer.chat_template,
                                                           "eos_token": "<|im_end|>"}))
    return out


def greedy(llm, prompts: list[str], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params)]


def exact(workdir: Path, tokens: int) -> bool:
    from sudu.engine.llm import LLM

    moe_dir = build_moe_dir(workdir / "moe-exact", top_k=NUM_EXPERTS, router_seed=None)
    dense = greedy(LLM(DENSE, progress=False, quantization="int8"), PROMPTS, tokens)
    moe = greedy(LLM(str(moe_dir), progress=False, quantization="int8"), PROMPTS, tokens)
    same = sum(a == b for a, b in zip(dense, moe))
    print(f"exact: all {NUM_EXPERTS} experts, unit gates, int8: {same}/{len(PROMPTS)} greedy outputs of "
          f"{tokens} tokens identical to the dense model")
    return same == len(PROMPTS)


def step_bytes(llm, expert_calls: int) -> float:
    """Bytes one decode step reads: every linear layer outside the experts (int8), the experts called,
    the float32 routers and norms, one embedding row."""
    from sudu.layers.linear import QuantizedLinear

    model = llm.engine.runner.model
    c = llm.engine.runner.model_cfg
    total = 0.0
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear) and ".experts." not in name:
            total += m.weight_bytes()
    for name, p in model.named_parameters():
        if "embed_tokens" not in name and ".experts." not in name:
            total += p.numel() * p.element_size()
    expert = next(m for n, m in model.named_modules() if n.endswith("experts.0"))
    per_expert = sum(m.weight_bytes() for m in expert.modules() if isinstance(m, QuantizedLinear))
    return total + expert_calls * per_expert + c.hidden_size * 4


def top2(workdir: Path, tokens: int) -> None:
    from sudu.engine.llm import LLM

    moe_dir = build_moe_dir(workdir / "moe-top2", top_k=2, router_seed=0)
    llm = LLM(str(moe_dir), progress=False, quantization="int8", num_threads=2)
    model = llm.engine.runner.model
    native = model._native_decode  # decode steps in one native call (kernels/decoder.cpp), routed layers too
    calls = [0]

    def count(*_):
        calls[0] += 1

    experts = [m for name, m in model.named_modules() if name.endswith(tuple(f"experts.{e}" for e in range(NUM_EXPERTS)))]
    greedy(llm, PROMPTS[:1], 4)  # warm-up
    layers = llm.engine.runner.model_cfg.num_hidden_layers
    for batch in (1, 8):
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(batch)]
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        # the experts a step calls, counted by hooks on the layer-by-layer path; the native stack routes the
        # same tokens to the same experts (bit for bit: tests/test_ops.py), so the count holds for it
        model._native_decode = None
        hooks = [m.register_forward_hook(count) for m in experts]
        calls[0] = 0
        llm.generate(prompts, params)
        expert_calls = calls[0] / tokens  # per step: one prefill step, then tokens - 1 decode steps
        for h in hooks:
            h.remove()
        model._native_decode = native
        t0 = time.perf_counter()
        results = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        decode_s = max(r.metrics.finished_time for r in results) - min(r.metrics.first_token_time for r in results)
        n = sum(len(r.token_ids) - 1 for r in results)
        tok_s = n / decode_s
        bandwidth = measure_bandwidth_gbs(threads=2)
        nbytes = step_bytes(llm, expert_calls)
        steps_per_s = tok_s / batch
        limit_steps = bandwidth * 1e9 / nbytes
        print(f"top-2 of 8, int8, batch {batch} ({'native stack' if native else 'layers'}): {tok_s:.1f} tok/s "
              f"({steps_per_s:.1f} steps/s), expert calls per step {expert_calls:.1f} of {layers * NUM_EXPERTS} "
              f"({expert_calls / layers:.2f} per layer), {nbytes / 1e6:.0f} MB read per step, bandwidth "
              f"{bandwidth:.1f} GB/s -> limit {limit_steps:.1f} steps/s, achieved {steps_per_s / limit_steps:.0%} "
              f"(wall {wall:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="exact,top2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--workdir", default="/tmp/sudu-moe-synthetic")
    args = ap.parse_args()
    torch.set_num_threads(2)
    parts = args.parts.split(",")
    if "exact" in parts:
        exact(Path(args.workdir), args.tokens)
    if "top2" in parts:
        top2(Path(args.workdir), args.tokens)


if __name__ == "__main__":
    main()
