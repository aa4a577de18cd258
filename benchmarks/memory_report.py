"""The engine's memory for a model: weights, KV pools (allocated and resident) and the process's resident
set after load and after a few requests, with the KV pools committed as they fill (the default) or
zero-filled at load (`--zero-fill`, what sudu did before), to compare the two in separate runs.

    flock /tmp/sudu-bench.lock python -m benchmarks.memory_report [--model M] [--zero-fill]
"""
from __future__ import annotations

import argparse

import torch

GIB = 1 << 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--zero-fill", action="store_true", help="zero every KV page at load, as torch.zeros does")
    args = p.parse_args()
    import sudu.layers.kv_cache as kv_cache

    if args.zero_fill:
        kv_cache.zeroed_pool = lambda shape, dtype, device="cpu": torch.zeros(shape, dtype=dtype, device=device)
    from sudu.engine.llm import LLM
    from sudu.engine.memory import kv_pool_tensors
    from sudu.host.memory import resident_bytes, rss_bytes
    from sudu.sampling import SamplingParams

    llm = LLM(args.model, progress=False)
    m = llm.engine.memory
    label = "zero-filled at load" if args.zero_fill else "committed as it fills"
    print(f"{label}: weights {m['memory_weights_bytes'] / GIB:.2f} GiB, KV pool {m['memory_kv_pool_bytes'] / GIB:.2f} "
          f"GiB ({max(0, m['memory_kv_resident_bytes']) / GIB:.2f} resident), resident set {m['memory_rss_bytes'] / GIB:.2f} GiB")
    llm.generate(["Write a haiku about caches."] * 8, SamplingParams(max_tokens=64, ignore_eos=True))
    pools = kv_pool_tensors(llm.engine.runner.kv_caches)
    print(f"{label}: after 8 x 64 tokens: KV resident {resident_bytes(pools) / GIB:.3f} GiB, resident set "
          f"{rss_bytes() / GIB:.2f} GiB")


if __name__ == "__main__":
    main()
