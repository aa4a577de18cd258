"""A cold prompt's time in the engine under settings of the prompt path's switches, taken in turn within one
process (prompt by prompt, the order reversed every round), so that the VM's drift and each process's own
memory placement reach every setting alike; the median time and the median per-round ratio to the first
setting.

    flock /tmp/sudu-bench.lock python -m benchmarks.prompt_paths [--model M] [--tokens 590,1500] \\
        [--settings "before:off:off:0,now:64:64:14"] [--rounds 6]

A setting is NAME:UNPACK:BYPASS:BLOCK_MIB:
  UNPACK     rows from which a GGUF tile's codes are assembled once per call (kernels.h KernelOptions::unpack_min_rows; VNNI)
  BYPASS     rows from which a call's outputs are written past the caches (KernelOptions::bypass_min_rows; VNNI)
  BLOCK_MIB  the MLP's row blocks, MiB of its float32 intermediate per block (layers/mlp.py BLOCK_BYTES; 0: none)
`off` for UNPACK or BYPASS: never. The switches change where values are computed and stored, never the
values (tests/test_gguf_native.py, tests/test_linear.py).

With --attention it times the prompt attention alone instead, on random data (a causal prompt of each length):
the native kernel (kernels/attention.cpp prompt_attention) in float32 and, where the CPU has them, on AMX's
bfloat16 tiles (kernels/attention_tiles.cpp), against SDPA's flash kernel with the kv heads expanded, with
SDPA's own grouped heads, and in bfloat16, per layer of the model's head geometry.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.prefill_chunks import cold_prompts_in_turn
from sudu import kernels
from sudu.engine.llm import LLM
from sudu.layers import mlp
from sudu.sampling import SamplingParams

NEVER = 1 << 40


def parse_setting(text: str) -> tuple[str, int, int, int]:
    try:
        name, unpack, bypass, block = text.split(":")
        rows = [NEVER if v == "off" else int(v) for v in (unpack, bypass)]
        if min(rows) < 1 or int(block) < 0:
            raise ValueError
        return name, rows[0], rows[1], int(block) << 20
    except ValueError:
        sys.exit(f"prompt_paths: a setting is NAME:UNPACK:BYPASS:BLOCK_MIB (rows or 'off', MiB), got {text!r}")


def prompts(args) -> None:
    ext = kernels.load()
    if ext is None:
        sys.exit("prompt_paths: the native kernels did not build on this machine")
    settings = [parse_setting(s) for s in args.settings.split(",")]
    llm = LLM(args.model, progress=False, enable_prefix_caching=False)
    rng, params = random.Random(0), SamplingParams(max_tokens=1, temperature=0)
    llm.generate([[rng.randrange(1000, 20000) for _ in range(300)]], params)  # warm-up
    print(f"{args.model}, kernels {ext.isa()}: cold prompt ms (median of {args.rounds}), "
          "and the median per-round ratio to the first setting", flush=True)
    saved = ext.kernel_options(), mlp.BLOCK_BYTES
    try:
        def apply(setting) -> None:
            changed = ext.kernel_options()
            changed.unpack_min_rows, changed.bypass_min_rows = setting[1], setting[2]
            ext.set_kernel_options(changed)
            mlp.BLOCK_BYTES = setting[3]

        for n in (int(t) for t in args.tokens.split(",")):
            times = cold_prompts_in_turn(llm, rng, n, settings, args.rounds, apply)
            base = times[settings[0]]
            print(f"  {n} tokens: " + "; ".join(
                f"{s[0]} {1e3 * statistics.median(v):.0f} ms ({statistics.median([b / a for a, b in zip(base, v)]):.3f})"
                for s, v in times.items()), flush=True)
    finally:
        ext.set_kernel_options(saved[0])
        mlp.BLOCK_BYTES = saved[1]


def attention(args) -> None:
    from sudu.weights.loader import load_checkpoint

    ext = kernels.load()
    if ext is None:
        sys.exit("prompt_paths: the native kernels did not build on this machine")
    cfg = load_checkpoint(args.model, progress=False).config
    H, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    print(f"{args.model} heads {H}/{Hk}, head size {D}: ms per layer's prompt attention (GFLOP/s, causal half)")

    def median_ms(f) -> float:
        f()
        times = []
        for _ in range(args.rounds * 3):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    for T in (int(t) for t in args.tokens.split(",")):
        q, k, v = torch.randn(T, H, D), torch.randn(T, Hk, D), torch.randn(T, Hk, D)
        out, none, slots = torch.empty(T, H, D), torch.empty(0), torch.arange(T)
        qs, ks, vs = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        ke, ve = ks.repeat_interleave(H // Hk, 1), vs.repeat_interleave(H // Hk, 1)
        qb, kb, vb = qs.bfloat16(), ks.bfloat16(), vs.bfloat16()
        paths = {
            "native": lambda: ext.prompt_attention(q, k, v, none, none, slots, out, 0, 0, D ** -0.5, False),
            "native, bfloat16 tiles": lambda: ext.prompt_attention(q, k, v, none, none, slots, out, 0, 0, D ** -0.5,
                                                                   True),
            "SDPA, heads expanded": lambda: F.scaled_dot_product_attention(qs, ke, ve, is_causal=True),
            "SDPA, grouped heads": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
            "SDPA bf16, grouped heads": lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True),
        }
        if not ext.bf16_tiles_granted():
            del paths["native, bfloat16 tiles"]
        flops = 2 * H * T * T * D  # QK^T and PV over the causal half
        print(f"  {T} tokens: " + "; ".join(
            f"{name} {ms:.2f} ms ({flops / ms / 1e6:.0f})" for name, ms in ((n, median_ms(f)) for n, f in paths.items())),
            flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--tokens", default="590,1500", help="prompt lengths")
    p.add_argument("--settings", default="before:off:off:0,now:64:64:14")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--attention", action="store_true", help="time the prompt attention alone")
    args = p.parse_args()
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        sys.exit(f"prompt_paths: --tokens must be comma-separated integers, got {args.tokens!r}")
    if args.rounds < 1 or min(lengths) < 1:
        sys.exit("prompt_paths: --tokens and --rounds must be positive")
    torch.set_num_threads(2)
    (attention if args.attention else prompts)(args)


if __name__ == "__main__":
    main()
