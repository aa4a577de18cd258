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

    flock /tmp/sudu-bench.lock python -m benchmarks.moe_synthetic [--parts exact,top2] [--tokens 64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from sudu.quant.formats import GROUP_SIZE
from sudu.commands.roofline import measure_bandwidth_gbs
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


def batch_prompts(batch: int) -> list[str]:
    """`batch` distinct prompts (the fixed ones, numbered)."""
    return [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(batch)]


def decode_rate(llm, batch: int, tokens: int) -> float:
    """Decode tok/s of `batch` greedy streams of `tokens` tokens (first token to last)."""
    results = llm.generate(batch_prompts(batch), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    decode_s = max(r.metrics.finished_time for r in results) - min(r.metrics.first_token_time for r in results)
    return sum(len(r.token_ids) - 1 for r in results) / decode_s


def count_expert_calls(llm, batch: int, tokens: int) -> float:
    """Expert calls per step, counted by hooks on the layer-by-layer path; the native stack routes the same
    tokens to the same experts (bit for bit: tests/test_ops.py), so the count holds for it."""
    model = llm.engine.runner.model
    native, model._native_decode = model._native_decode, None
    calls = [0]
    experts = [m for name, m in model.named_modules() if name.endswith(tuple(f"experts.{e}" for e in range(NUM_EXPERTS)))]
    hooks = [m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in experts]
    try:
        greedy(llm, batch_prompts(batch), tokens)
    finally:
        for h in hooks:
            h.remove()
        model._native_decode = native
    return calls[0] / tokens  # per step: one prefill step, then tokens - 1 decode steps


def top2(workdir: Path, tokens: int, rounds: int) -> None:
    """Batch 1: `rounds` interleaved rounds of (routed decode, bandwidth probe, dense decode, bandwidth
    probe), each decode's fraction of the roofline taken against the probe right after it; this VM's
    bandwidth moves by a quarter over minutes, so one run is not a figure, the median of the rounds is.
    Batch 8: one run next to the bytes of the union of experts the batch touched."""
    import statistics

    from sudu.engine.llm import LLM
    from sudu.commands.roofline import bytes_per_token

    moe_dir = build_moe_dir(workdir / "moe-top2", top_k=2, router_seed=0)
    llm = LLM(str(moe_dir), speculative="none", progress=False, quantization="int8", num_threads=2)
    dense = LLM(DENSE, speculative="none", progress=False, quantization="int8", num_threads=2)
    layers = llm.engine.runner.model_cfg.num_hidden_layers
    dense_bytes = bytes_per_token(dense.engine.runner.model_cfg, "int8")
    for m in (llm, dense):
        greedy(m, PROMPTS[:1], 4)  # warm-up
    calls = count_expert_calls(llm, 1, tokens)
    nbytes = step_bytes(llm, calls)
    print(f"top-2 of 8, int8, batch 1: {calls:.1f} expert calls per step of {layers * NUM_EXPERTS} "
          f"({calls / layers:.2f} per layer), {nbytes / 1e6:.0f} MB read per step; dense int8 {dense_bytes / 1e6:.0f} MB")
    fractions = {"routed": [], "dense": []}
    for r in range(rounds):
        line = []
        for name, model, step in (("routed", llm, nbytes), ("dense", dense, dense_bytes)):
            tok_s = decode_rate(model, 1, tokens)
            bandwidth = measure_bandwidth_gbs(threads=2)
            achieved = tok_s * step / (bandwidth * 1e9)
            fractions[name].append(achieved)
            line.append(f"{name} {tok_s:.1f} tok/s, bandwidth after {bandwidth:.1f} GB/s -> {achieved:.0%}")
        print(f"  round {r + 1}/{rounds}: " + "; ".join(line), flush=True)
    for name, values in fractions.items():
        print(f"batch 1, {name}: median {statistics.median(values):.0%} of the roofline "
              f"(rounds: {', '.join(f'{v:.0%}' for v in values)})")
    print(f"routed / dense efficiency, median of the rounds' ratios: "
          f"{statistics.median(a / b for a, b in zip(fractions['routed'], fractions['dense'])):.2f}")
    calls = count_expert_calls(llm, 8, tokens)
    nbytes = step_bytes(llm, calls)
    tok_s = decode_rate(llm, 8, tokens)
    bandwidth = measure_bandwidth_gbs(threads=2)
    print(f"top-2 of 8, int8, batch 8: {tok_s:.1f} tok/s ({tok_s / 8:.1f} steps/s), union of experts "
          f"{calls / layers:.2f} of {NUM_EXPERTS} per layer, {nbytes / 1e6:.0f} MB read per step, bandwidth after "
          f"{bandwidth:.1f} GB/s -> {tok_s / 8 * nbytes / (bandwidth * 1e9):.0%} of the roofline")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="exact,top2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved routed/dense rounds at batch 1")
    ap.add_argument("--workdir", default="/tmp/sudu-moe-synthetic")
    args = ap.parse_args()
    torch.set_num_threads(2)
    parts = args.parts.split(",")
    if "exact" in parts:
        exact(Path(args.workdir), args.tokens)
    if "top2" in parts:
        top2(Path(args.workdir), args.tokens, args.rounds)


if __name__ == "__main__":
    main()
