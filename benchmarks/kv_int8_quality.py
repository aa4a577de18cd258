"""How far each KV pool format moves a model's predictions from a float32 pool, teacher-forced over a long
real text: greedy agreement, perplexity and mean KL divergence per position, and the share of int8 values
that saturate.

Formats: float16; int8 with per-channel scales around zero (the scheme before K centres); int8 as sudu sets
it now (K around its centre where the rotary tables allow, layers/kv_cache.py). The int8 scales come from
the engine's calibration pass (engine/kv_calibration.py), never from the text measured. Every format's pass
runs the same kernels (float32 attention), so the differences are the pool's.

    python -m benchmarks.kv_int8_quality [--model NAME] [--tokens 4096] [--text PATH ...]
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch

TEXTS = [pathlib.Path("/usr/share/common-licenses/GFDL-1.3"), pathlib.Path("/usr/share/common-licenses/GPL-3")]
LOGIT_ROWS = 64


def pools_for(fmt: str, cfg, n: int, ranges: dict) -> list:
    from sudu.engine.kv_calibration import set_int8_ranges
    from sudu.layers.kv_cache import Int8KVCache, KVCache

    heads, k_dim, v_dim = cfg.kv_cache_shape()
    layers = cfg.num_hidden_layers
    if fmt in ("float32", "float16"):
        dtype = torch.float32 if fmt == "float32" else torch.float16
        return [KVCache(n, heads, k_dim, dtype, v_head_dim=v_dim) for _ in range(layers)]
    pools = [Int8KVCache(n, heads, k_dim, v_head_dim=v_dim) for _ in range(layers)]
    set_int8_ranges(pools, ranges[fmt])
    return pools


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--text", type=pathlib.Path, action="append", help="text files, concatenated (default: licences)")
    args = ap.parse_args(argv)
    from sudu.engine.kv_calibration import calibration_pass, int8_ranges
    from sudu.engine.llm import LLM
    from sudu.engine.text_eval import forward_text
    from sudu.layers.kv_cache import KV_SCALE_MARGIN, calibration_ids, network_ids

    paths = args.text or TEXTS
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        sys.exit(f"kv_int8_quality: no such text: {', '.join(missing)}")
    llm = LLM(args.model, progress=True, kv_cache_dtype="float32", speculative="none", attention_arithmetic="float32")
    model = llm.engine.runner.model
    cfg = model.config
    ids = network_ids(llm.tokenizer.encode("\n".join(p.read_text() for p in paths), add_special_tokens=False), cfg)
    ids = ids[:args.tokens]
    n = len(ids)
    recorders = calibration_pass(model, calibration_ids(llm.tokenizer, cfg))
    ranges = {"int8 centred K": int8_ranges(recorders),
              "int8 around zero": [(r.k_max * KV_SCALE_MARGIN, r.v_max * KV_SCALE_MARGIN, None) for r in recorders]}
    formats = ["float32", "float16", "int8 around zero", "int8 centred K"]
    hidden, saturated = {}, {}
    for fmt in formats:
        print(f"  {fmt}: one pass over {n} tokens", file=sys.stderr, flush=True)
        pools = pools_for(fmt, cfg, n, ranges)
        hidden[fmt] = forward_text(model, ids, pools)[:-1]
        if fmt.startswith("int8"):
            saturated[fmt] = tuple(sum((getattr(p, part).abs() == 127).sum().item() for p in pools)
                                   / sum(getattr(p, part).numel() for p in pools) for part in ("k", "v"))
    target = torch.tensor(ids[1:])
    agree, logp, kl = ({f: 0.0 for f in formats} for _ in range(3))
    with torch.inference_mode():
        for a in range(0, n - 1, LOGIT_ROWS):
            ref = torch.log_softmax(model.compute_logits(hidden["float32"][a:a + LOGIT_ROWS]).float(), -1)
            for fmt in formats:
                lp = torch.log_softmax(model.compute_logits(hidden[fmt][a:a + LOGIT_ROWS]).float(), -1)
                agree[fmt] += (lp.argmax(-1) == ref.argmax(-1)).sum().item()
                logp[fmt] += lp.gather(1, target[a:a + LOGIT_ROWS, None]).sum().item()
                kl[fmt] += (ref.exp() * (ref - lp)).sum().item()
    print(f"{llm.engine.config.model or 'default model'}, {n} tokens teacher-forced, against a float32 pool")
    print("| format | greedy agreement | perplexity | mean KL (nats) | saturated K / V |")
    print("|---|---:|---:|---:|---|")
    for fmt in formats[1:]:
        rise = math.exp((logp["float32"] - logp[fmt]) / (n - 1)) - 1
        sat = saturated.get(fmt)
        sat_text = f"{sat[0]:.1e} / {sat[1]:.1e}" if sat else "-"
        print(f"| {fmt} | {agree[fmt] / (n - 1):.2%} | {rise:+.2%} | {kl[fmt] / (n - 1):.2e} | {sat_text} |")


if __name__ == "__main__":
    main()
