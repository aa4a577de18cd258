"""The native GGUF kernels on a model's own tensors: `qlinear` on layer 0's gate, down and q projections
(the file's blocks, as `--quantization native` runs them) at each activation row count, median ms per call
and GFLOP/s. Row counts of 1-8 are decode and speculation, 64-512 a prompt's chunks.

    python -m benchmarks.native_kernels [--model qwen2.5-coder-1.5b-instruct] [--rows 1,4,64,256,512] [--gemm | --amx] [--more]

By default each row count takes the path the engine takes (the integer kernel below PREFILL_MIN_ROWS, the
dequantize + GEMM from there: layers/linear.py prefill_path). --gemm times both at every row count, the
GEMM in bfloat16 and in float32, so the switch can be read off this CPU. --amx times the integer kernel with
AMX int8 tiles (the same bits) against it without them (AVX-512 VNNI) and --fast-math's bfloat16 GEMM.

To compare two builds side by side, run it alternately from a worktree of each, each with its own
SUDU_HOME (the kernels' build cache) sharing the models:
    git worktree add /tmp/base <commit>; mkdir -p /tmp/home-base; ln -s ~/.cache/sudu/models /tmp/home-base/
    (cd /tmp/base && SUDU_HOME=/tmp/home-base PYTHONPATH=/tmp/base python -m benchmarks.native_kernels)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from contextlib import nullcontext

from sudu import kernels
from sudu.layers import gguf_native, linear
from sudu.weights.loader import load_checkpoint

TENSORS = ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
           "model.layers.0.self_attn.q_proj.weight")
# the default model's other formats: a Q4_K down projection and a Q8_0 v projection
MORE_TENSORS = ("model.layers.2.mlp.down_proj.weight", "model.layers.0.self_attn.v_proj.weight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--rows", default="1,4,64,256,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gemm", action="store_true", help="time the integer kernel and both GEMMs at every row count")
    p.add_argument("--amx", action="store_true",
                   help="time the integer kernel with AMX tiles and without (VNNI) and the bfloat16 GEMM at every row count")
    p.add_argument("--more", action="store_true", help=f"also {', '.join(MORE_TENSORS)}")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.model, progress=False)
    ext = kernels.load()
    if args.amx and (ext is None or not ext.cpu_has_amx()):
        p.error("--amx: this CPU has no AMX int8 tiles, or the OS does not grant them")
    print(f"{args.model}, {args.threads} threads: median ms per call (GFLOP/s)")
    for name in TENSORS + (MORE_TENSORS if args.more else ()):
        qt = ckpt.quantized(name)
        if qt is None or qt.ggml_type not in gguf_native.NATIVE_TYPES:
            print(f"{name}: not a native tensor in this file")
            continue
        layer = gguf_native.native_layer(qt, None)
        n, k = qt.shape
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            paths = [("kernel", linear.NEVER, torch.float32), ("bf16 GEMM", 1, torch.bfloat16),
                     ("f32 GEMM", 1, torch.float32)] if args.gemm else [(None, linear.PREFILL_MIN_ROWS, linear.PREFILL_DTYPE)]
            if args.amx:  # the kernel with AMX tiles (from 16 rows here), without them, and --fast-math's GEMM
                paths = [("amx", linear.NEVER, torch.float32), ("vnni", linear.NEVER, torch.float32),
                         ("bf16 GEMM", 1, torch.bfloat16)]
            for path, min_rows, dtype in paths:
                amx = {"amx": {"amx": True, "amx_min_rows": 16}, "vnni": {"amx": False}}.get(path)
                with linear.prefill_path_as(min_rows, dtype), (kernels.options(**amx) if amx else nullcontext()):
                    ms = median_ms(layer, x)
                label = f" {path:9}" if path else ""
                print(f"  {name.split('.')[-2]:10} {qt.ggml_type:5} {n}x{k} rows {m:4}{label}: {ms:8.3f} ms "
                      f"({2 * m * n * k / ms / 1e6:6.1f})", flush=True)


def median_ms(layer, x: torch.Tensor) -> float:
    layer(x)
    times = []
    for _ in range(50 if x.shape[0] <= 8 else 7):
        t = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    main()
