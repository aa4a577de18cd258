"""Quality of the weight formats on a GGUF: sudu's `native` (the file's own blocks), its int8 and int4
re-quantizations, against the file's dequantized float32 model and against llama.cpp's `llama-perplexity`
on the same file.

Two measurements per format:
  * greedy agreement: the float32 model (`--quantization none`: the file's values dequantized) writes greedy
    completions of PROMPTS; each format, fed the same tokens (teacher forcing), picks the same next token at
    what fraction of the positions (len(PROMPTS) x --tokens, 2,048 by default);
  * perplexity of a held text (Python's own LICENSE.txt and the start of its pydoc topics, found in every
    Python install and in none of sudu's tests), computed as llama-perplexity computes it: the text cut into
    chunks of --ctx tokens, each run from scratch, the second half of each chunk scored. With --llama-perplexity
    the binary runs on the same file, text and thread count, and its figure is printed beside sudu's.
Every row goes through the decode kernels (int8-rounded activations), as decoding computes it. The weight
formats run over a float32 KV pool; --kv-formats adds rows of native weights over other KV pools.

    python -m benchmarks.native_quality [--model NAME] [--llama-perplexity PATH] [--kv-formats float16,int8,auto]
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Explain the difference between a process and a thread in three short paragraphs.",
    "Write a SQL query that returns the ten customers with the highest total order value in 2023.",
    "Implement binary search in C and explain its time complexity.",
    "Write a bash script that renames every .jpeg file in a directory to .jpg.",
    "What is a race condition? Give an example in Go and show how to fix it.",
    "Write a JavaScript debounce function and explain when to use it.",
    "Summarise how HTTPS protects a request, step by step.",
    "Write a Rust function that parses a comma-separated line of integers into a Vec<i64>.",
    "Explain what a B-tree is and why databases use them.",
    "Write a Python class for an LRU cache with get and put in O(1).",
    "Describe three ways to reduce the memory use of a Python program.",
    "Write unit tests with pytest for a function that adds two fractions.",
    "How does garbage collection work in Java? Keep it short.",
    "Write a regular expression that matches ISO 8601 dates and explain each part.",
    "Convert this loop to a list comprehension: for x in xs: if x > 0: out.append(x * x)",
]


def held_text(max_chars: int = 45_000) -> str:
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    license_text = (lib / "LICENSE.txt").read_text()
    from pydoc_data import topics

    docs = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return (license_text + "\n\n" + docs)[:max_chars]


def make_llm(model: str, fmt: str, threads: int, kv: str = "float32"):
    from sudu.engine.llm import LLM

    return LLM(model, progress=False, quantization=fmt, kv_cache_memory=256 << 20, num_threads=threads,
               kv_cache_dtype=kv)


def logits_of(llm, ids: list[int]) -> torch.Tensor:
    from sudu.engine.text_eval import text_logits

    runner = llm.engine.runner
    return text_logits(runner.model, ids, runner.kv_caches)


def chunk_perplexity(llm, ids: list[int], ctx: int) -> tuple[float, int]:
    """llama-perplexity's figure: chunks of ctx tokens, each opening with BOS where the model adds one,
    positions ctx/2 .. ctx-2 predicting the next token."""
    nll, count = 0.0, 0
    tok = llm.tokenizer
    for c in range(len(ids) // ctx):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if tok.add_bos and tok.bos_token_id is not None:
            chunk = [tok.bos_token_id] + chunk[1:]
        logp = torch.log_softmax(logits_of(llm, chunk).double(), dim=-1)
        first = ctx // 2
        targets = torch.tensor(chunk[first + 1:])
        nll -= logp[first:ctx - 1].gather(1, targets.unsqueeze(1)).sum().item()
        count += len(targets)
    return math.exp(nll / count), len(ids) // ctx


def agreement(llm, sequences: list[tuple[list[int], list[int]]]) -> tuple[float, int]:
    hits = total = 0
    for prompt, completion in sequences:
        ids = prompt + completion
        pred = logits_of(llm, ids)[len(prompt) - 1:len(ids) - 1].argmax(dim=-1)
        hits += int((pred == torch.tensor(completion)).sum())
        total += len(completion)
    return hits / total, total


def llama_perplexity(binary: str, gguf: Path, text: str, ctx: int, threads: int) -> tuple[float, int]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        out = subprocess.run([binary, "-m", str(gguf), "-f", f.name, "-c", str(ctx), "-b", str(ctx), "-t", str(threads)],
                             capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"llama-perplexity failed ({out.returncode}): {log[-800:]}")
    return float(m.group(1)), int(chunks.group(1)) if chunks else -1


def main() -> None:
    from sudu.sampling import SamplingParams
    from sudu.weights.catalog import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--formats", default="native,int8,int4", help="weight formats (over a float32 KV pool)")
    parser.add_argument("--kv-formats", default="", help="KV pool formats to measure with native weights, e.g. "
                        "float16,bfloat16,int8,auto")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-perplexity", default=None, help="path of llama.cpp's llama-perplexity binary")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = held_text()

    t0 = time.time()
    print(f"float32 reference: {len(PROMPTS)} greedy completions of {args.tokens} tokens ...", flush=True)
    ref = make_llm(args.model, "none", args.threads)
    prompts = [ref.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    results = ref.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
    sequences = [(p, r.token_ids) for p, r in zip(prompts, results)]
    ids = ref.tokenizer.encode(text)
    rows = {"none (float32)": (1.0, sum(len(c) for _, c in sequences), *chunk_perplexity(ref, ids, args.ctx))}
    print(f"  done in {time.time() - t0:.0f} s; held text {len(ids)} tokens", flush=True)
    del ref
    gc.collect()
    runs = [(fmt, fmt, "float32") for fmt in args.formats.split(",") if fmt]
    runs += [(f"native, KV {kv}", "native", kv) for kv in args.kv_formats.split(",") if kv]
    for name, fmt, kv in runs:
        t0 = time.time()
        print(f"{name} ...", flush=True)
        llm = make_llm(args.model, fmt, args.threads, kv)
        if kv == "auto":
            name = f"native, KV auto = {llm.engine.config.kv_cache_dtype}"
        agree, n = agreement(llm, sequences)
        rows[name] = (agree, n, *chunk_perplexity(llm, ids, args.ctx))
        print(f"  done in {time.time() - t0:.0f} s", flush=True)
        del llm
        gc.collect()
    base_ppl = rows["none (float32)"][2]
    print(f"\n{args.model}: greedy agreement with the file's float32 model over {n} positions; perplexity of the "
          f"held text ({len(ids)} tokens, {args.ctx}-token chunks, second halves scored), {args.threads} threads\n")
    print("| format | greedy agreement | perplexity | vs float32 |\n|---|---:|---:|---:|")
    for name, (agree, n, ppl, _) in rows.items():
        print(f"| sudu {name} | {agree:.2%} | {ppl:.4f} | {ppl / base_ppl - 1:+.2%} |")
    if args.llama_perplexity:
        ppl, chunks = llama_perplexity(args.llama_perplexity, resolve_model_path(args.model), text, args.ctx, args.threads)
        ours = rows.get("native", rows["none (float32)"])[2]
        print(f"| llama.cpp llama-perplexity ({chunks} chunks; sudu {rows['none (float32)'][3]}) | | {ppl:.4f} | "
              f"{ppl / base_ppl - 1:+.2%} |")
        print(f"\nsudu native / llama-perplexity: {ours / ppl - 1:+.2%}")


if __name__ == "__main__":
    main()
