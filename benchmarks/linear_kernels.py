"""Linear-layer kernels side by side on the 0.5B model's shapes, per activation row count M.

Candidates: float32 F.linear, float32 x @ W^T pre-transposed, PyTorch's packed int8 (bf16 activations,
per-channel) and int4 (bf16 activations, groups of 32) kernels, and sudu's int8 / int4 layers (native
kernel below PREFILL_MIN_ROWS rows, dequantize + GEMM from there). Prints median milliseconds over
`--repeat` interleaved rounds (one process, candidates alternate so machine noise hits all alike) and
the weight bandwidth each achieves at M = 1. `--isa` adds sudu's kernel once per instruction set (AVX2
forced, and the CPU's own: AVX-512 VNNI where present), which compute bit-identical results.

    python -m benchmarks.linear_kernels [--rows 1,2,4,8,16,32,48,64,128] [--repeat 15] [--isa]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from sudu import kernels
from sudu.layers import linear as L
from sudu.quant import formats as QF

SHAPES = {"gate/up 896->4864": (4864, 896), "down 4864->896": (896, 4864), "lm_head 896->151936": (151936, 896)}


def candidates(n: int, k: int, by_isa: bool = False):
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    wt = w.t().contiguous()
    q8, s8 = QF.quantize_int8(w, group_size=k)  # per-channel, the layout PyTorch's int8 kernel takes
    s8 = s8.float().reshape(n).bfloat16()
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed4 = torch._convert_weight_to_int4pack_for_cpu(q4, 2)
    sz4 = torch.randn(k // 32, n, 2).bfloat16() * 0.01
    sudu8 = L.QuantizedLinear.from_float("int8", w)
    sudu4 = L.QuantizedLinear.from_float("int4", w)
    fns = {
        "fp32 F.linear": lambda x: F.linear(x, w),
        "fp32 x@Wt": lambda x: x @ wt,
        "torch int8pack bf16": lambda x: torch._weight_int8pack_mm(x.bfloat16(), q8, s8).float(),
        "torch int4pack bf16": lambda x: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed4, 32, sz4).float(),
        "sudu int8": sudu8,
        "sudu int4": sudu4,
    }
    nbytes = {"fp32 F.linear": 4.0 * n * k, "fp32 x@Wt": 4.0 * n * k, "torch int8pack bf16": 1.0 * n * k,
              "torch int4pack bf16": 0.5 * n * k, "sudu int8": sudu8.weight_bytes(), "sudu int4": sudu4.weight_bytes()}
    ext = kernels.load()
    if by_isa and ext is not None:
        for isa in ("avx2", "native"):
            def run(x, isa=isa):
                with kernels.options(vnni=isa == "native" and ext.cpu_has_vnni()):
                    return ext.qlinear(x, sudu4.qweight, None)
            name = f"sudu int4 {isa}"
            fns[name], nbytes[name] = run, sudu4.weight_bytes()
    return fns, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,48,64,128")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated keys of SHAPES")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", action="store_true", help="also sudu's int4 kernel per instruction set")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = kernels.load()
    print(f"native kernels: {ext.isa() if ext is not None else 'off'}; PREFILL_MIN_ROWS={L.PREFILL_MIN_ROWS} "
          f"({L.PREFILL_DTYPE}); "
          f"threads={args.threads}")
    rows = [int(r) for r in args.rows.split(",")]
    for shape_name in args.shapes.split(","):
        n, k = SHAPES[shape_name]
        fns, nbytes = candidates(n, k, args.isa)
        print(f"\n{shape_name} (N={n}, K={k}): median ms per call")
        print(f"{'M':>4} " + " ".join(f"{name:>20}" for name in fns))
        for m in rows:
            x = torch.randn(m, k)
            with torch.inference_mode():
                for f in fns.values():
                    f(x)
                times = {name: [] for name in fns}
                for _ in range(args.repeat):
                    for name, f in fns.items():
                        t0 = time.perf_counter()
                        f(x)
                        times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(f"{m:>4} " + " ".join(f"{med[name]:>20.3f}" for name in fns))
            if m == 1:
                print("GB/s " + " ".join(f"{nbytes[name] / med[name] / 1e6:>20.1f}" for name in fns))


if __name__ == "__main__":
    main()
