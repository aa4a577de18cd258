"""Single-stream greedy decode: sudu vs transformers' generate on the same model, side by side in one
run (issue: Foundation). Decode tok/s = (new tokens - 1) / (time after the first token); both sides
also report end-to-end time. Median of --repeat alternating runs; prints the ratio.

    python benchmarks/decode_vs_transformers.py [--model qwen2.5-coder-0.5b-instruct] [--tokens 128]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.hf_baseline import load_hf
from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams

PROMPT = "Write a Python function that returns the longest palindromic substring of a string, with tests."


def sudu_decode(llm: LLM, prompt_ids: list[int], n: int) -> tuple[float, float, list[int]]:
    t0 = time.perf_counter()
    r = llm.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
    e2e = time.perf_counter() - t0
    m = r.metrics
    return (n - 1) / (m.finished_time - m.first_token_time), e2e, r.token_ids


def hf_decode(hf, prompt_ids: list[int], n: int) -> tuple[float, float, list[int]]:
    # time the first token apart: decode speed excludes the prefill, as on the sudu side
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        t2 = time.perf_counter()
    e2e = t2 - t1
    return (n - 1) / (e2e - (t1 - t0)), e2e, out[0, len(prompt_ids):].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="auto", help="sudu's weight format (auto: its default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, speculative="none", num_threads=args.threads, quantization=args.quantization)
    prompt_ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    hf, _ = load_hf(args.model)
    rows = {"sudu": [], "transformers": []}
    for i in range(args.repeat):
        s_tps, s_e2e, s_ids = sudu_decode(llm, prompt_ids, args.tokens)
        h_tps, h_e2e, h_ids = hf_decode(hf, prompt_ids, args.tokens)
        same = sum(a == b for a, b in zip(s_ids, h_ids))
        print(f"run {i + 1}: sudu {s_tps:.2f} tok/s, transformers {h_tps:.2f} tok/s, "
              f"greedy tokens equal {same}/{args.tokens}", flush=True)
        rows["sudu"].append((s_tps, s_e2e))
        rows["transformers"].append((h_tps, h_e2e))
    s = statistics.median(t for t, _ in rows["sudu"])
    h = statistics.median(t for t, _ in rows["transformers"])
    print(f"\n| engine | decode tok/s (median of {args.repeat}) | e2e s for {args.tokens} tokens |")
    print("|---|---|---|")
    for name, vals in rows.items():
        print(f"| {name} | {statistics.median(t for t, _ in vals):.2f} | {statistics.median(e for _, e in vals):.2f} |")
    print(f"\nratio sudu / transformers: {s / h:.2f}x  (model {args.model}, sudu weights {llm.engine.quantization}, "
          f"{args.threads} threads)")


if __name__ == "__main__":
    main()
