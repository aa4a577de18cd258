"""Host time the CUDA path spends per step turning block tables into its metadata (cuda/step.py block_tables and
new_token_slots), which runs on the CPU every step, GPU or not: B sequences of N blocks each, one new token each.

    python -m benchmarks.cuda_step_host [--blocks 128] [--repeat 200]
"""
from __future__ import annotations

import argparse
import time

from sudu.cuda.step import block_tables, new_token_slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=128, help="blocks per sequence (128 x 16 = 2,048 positions)")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    nb, bs = args.blocks, 16
    print(f"{'sequences':>9} {'block_tables ms':>16} {'new_token_slots ms':>19}")
    for b in (1, 8, 32, 64):
        tables = [list(range(i * nb, (i + 1) * nb)) for i in range(b)]
        positions = [nb * bs - 1] * b
        ends = [p + 1 for p in positions]
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            bt = block_tables(tables, nb)
        t1 = time.perf_counter()
        for _ in range(args.repeat):
            new_token_slots(bt, positions, ends, bs)
        t2 = time.perf_counter()
        print(f"{b:9} {1e3 * (t1 - t0) / args.repeat:16.3f} {1e3 * (t2 - t1) / args.repeat:19.3f}")


if __name__ == "__main__":
    main()
