"""sudu vs llama.cpp (llama-cpp-python) on the same GGUF, same token ids, same thread count, one run.

Measures, for each side:
  decode      single-stream greedy decode tok/s: (tokens - 1) / (last token time - first token time)
  prompt      prompt processing tok/s on a 512-token prompt: 512 / time to the first token
  batch N     aggregate output tok/s with N concurrent sequences (short distinct prompts, greedy,
              ignore EOS): total generated tokens / wall time from submission to the last token
  decode @C   single-stream decode tok/s after a C-token prompt (attention over a long context; sudu's KV
              pool in --kv-cache-dtype, llama.cpp's in its default float16)
and prints sudu / llama.cpp ratios, plus the decode roofline of sudu's weight format: each sudu decode
run against the bandwidth measured right after it (this VM's moves by 2x within an hour).

llama.cpp runs through llama-cpp-python's low-level C API (llama_batch with one sequence id per
sequence, n_seq_max = N, unified KV cache): every step decodes all N sequences in one llama_decode,
which is what llama.cpp's own batched server does. Greedy picking is an argmax over each row's logits
on both sides. Each figure is the median of --repeat runs; the two engines alternate within a repeat.

Both sides start every run with nothing cached: llama.cpp's KV is cleared before each run, and every
prompt sudu gets opens with a fresh salt, so its prefix cache cannot serve a prompt it saw in an
earlier repeat or warm-up.

    pip install 'sudu[bench-llamacpp]'    # or: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python
    python benchmarks/vs_llamacpp.py [--quantization int8] [--batches 8,32] [--contexts 1000,4000]
                                     [--kv-cache-dtype int8] [--repeat 3]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
import uuid

import numpy as np
import torch

MODEL = "qwen2.5-coder-0.5b-instruct"
TOPICS = ["binary search", "a linked list", "quicksort", "an LRU cache", "a trie", "Dijkstra's algorithm",
          "a bloom filter", "merge sort", "a ring buffer", "a thread pool", "JSON parsing", "a rate limiter",
          "matrix multiplication", "a heap", "union-find", "a hash map", "breadth-first search", "a stack",
          "a queue", "string reversal", "prime sieving", "FizzBuzz", "a calculator", "a tokenizer", "a cron parser",
          "an interval tree", "a bitset", "run-length encoding", "base64", "a skip list", "topological sort",
          "a regex matcher", "a B-tree", "Huffman coding"]


def salted(tokenizer, text: str) -> list[int]:
    """A chat prompt that no earlier run has sent: a fresh salt opens it (see the module docstring)."""
    return tokenizer.encode_chat([{"role": "user", "content": f"[{uuid.uuid4().hex}] {text}"}])


def batch_prompts(tokenizer, n: int) -> list[list[int]]:
    return [salted(tokenizer, f"Implement {TOPICS[i % len(TOPICS)]} in Python (variant {i}).") for i in range(n)]


def long_prompt(tokenizer, n_tokens: int) -> list[int]:
    text = open(__file__).read()
    ids = tokenizer.encode(f"# {uuid.uuid4().hex}\n" + text * (1 + 4 * n_tokens // max(1, len(text))), add_special_tokens=False)
    return ids[:n_tokens]


# ---- sudu -----------------------------------------------------------------------------------------
class Sudu:
    def __init__(self, model: str, quantization: str, threads: int, max_seqs: int, kv_cache_dtype: str):
        from sudu.engine.llm import LLM

        self.llm = LLM(model, speculative="none", progress=False, quantization=quantization, num_threads=threads,
                       max_num_seqs=max(max_seqs, 1), kv_cache_memory=1 << 30, kv_cache_dtype=kv_cache_dtype)

    def _params(self, n):
        from sudu.sampling import SamplingParams

        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def decode(self, prompt: list[int], n: int) -> float:
        r = self.llm.generate([prompt], self._params(n))[0]
        return (len(r.token_ids) - 1) / (r.metrics.finished_time - r.metrics.first_token_time)

    def prompt(self, prompt: list[int]) -> float:
        r = self.llm.generate([prompt], self._params(1))[0]
        return len(prompt) / (r.metrics.first_token_time - r.metrics.arrival_time)

    def batch(self, prompts: list[list[int]], n: int) -> float:
        t0 = time.perf_counter()
        results = self.llm.generate(prompts, self._params(n))
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0)


# ---- llama.cpp ------------------------------------------------------------------------------------
class LlamaCpp:
    def __init__(self, path: str, threads: int, max_seqs: int, n_ctx: int):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self._quiet = lc.llama_log_callback(lambda level, text, user: None)
        lc.llama_log_set(self._quiet, ctypes.c_void_p(0))
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, 512, 512
        p.n_seq_max = max(1, max_seqs)
        p.kv_unified = True  # one KV pool shared by all sequences, as in sudu
        p.n_threads = p.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, p)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch_buf = lc.llama_batch_init(512, 0, p.n_seq_max)

    def _clear(self):
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def _decode(self, entries):
        """entries: (token, pos, seq_id, wants_logits). Returns argmax token per wanted row, in order."""
        b = self.batch_buf
        out = []
        for start in range(0, len(entries), 512):
            chunk = entries[start:start + 512]
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, logits) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(logits)
                b.seq_id[i][0] = seq
            if self.lc.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for i, (_, _, _, logits) in enumerate(chunk):
                if logits:
                    row = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                    out.append(int(row.argmax()))
        return out

    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, float, int]:
        """Returns (time to first tokens, time of the rest, tokens generated)."""
        self._clear()
        t0 = time.perf_counter()
        entries = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last = self._decode(entries)
        t1 = time.perf_counter()
        lengths = [len(p) for p in prompts]
        for step in range(n - 1):
            last = self._decode([(tok, lengths[s] + step, s, True) for s, tok in enumerate(last)])
        return t1 - t0, time.perf_counter() - t1, n * len(prompts)

    def decode(self, prompt, n):
        _, rest, _ = self.generate([prompt], n)
        return (n - 1) / rest

    def prompt(self, prompt):
        first, _, _ = self.generate([prompt], 1)
        return len(prompt) / first

    def batch(self, prompts, n):
        first, rest, total = self.generate(prompts, n)
        return total / (first + rest)


def main() -> None:
    from sudu.config import EngineConfig
    from sudu.commands.roofline import bytes_per_token, measure_bandwidth_gbs
    from sudu.weights.catalog import resolve_model_path
    from sudu.weights.loader import load_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--quantization", default=EngineConfig.quantization)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--batch-tokens", type=int, default=32, help="tokens generated per sequence in batch runs")
    parser.add_argument("--contexts", default="1000,4000", help="prompt lengths for the long-context decode runs")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="sudu's KV pool")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = str(resolve_model_path(args.model))
    ckpt = load_checkpoint(args.model, progress=False)
    tok = ckpt.tokenizer
    batches = [int(b) for b in args.batches.split(",") if b]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    max_seqs = max(batches + [1])
    n_ctx = max([4096, max_seqs * 160] + [c + args.decode_tokens + 16 for c in contexts])
    sides = {"sudu": Sudu(args.model, args.quantization, args.threads, max_seqs, args.kv_cache_dtype),
             "llama.cpp": LlamaCpp(path, args.threads, max_seqs, n_ctx=n_ctx)}
    def decode_prompt():
        return salted(tok, "Write a Python function that merges two sorted lists, with a docstring and tests.")

    results: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    for name, side in sides.items():  # warm-up: first-call costs (kernel compile, page faults) stay out
        side.decode(decode_prompt(), 4)
        if batches:
            side.batch(batch_prompts(tok, 2), 2)
    # This VM's bandwidth moves with its neighbours (30-60 GB/s within an hour), so each sudu decode run is
    # paired with a bandwidth measurement taken right after it, and the roofline fraction is per pair.
    bandwidths: list[float] = []
    for r in range(args.repeat):
        for name, side in sides.items():
            res = results[name]
            res.setdefault("decode", []).append(side.decode(decode_prompt(), args.decode_tokens))
            if name == "sudu":
                bandwidths.append(measure_bandwidth_gbs(threads=args.threads))
            res.setdefault("prompt", []).append(side.prompt(long_prompt(tok, args.prompt_tokens)))
            for b in batches:
                res.setdefault(f"batch {b}", []).append(side.batch(batch_prompts(tok, b), args.batch_tokens))
            for c in contexts:
                res.setdefault(f"decode @{c}", []).append(side.decode(long_prompt(tok, c),
                                                                      args.decode_tokens))
            print(f"repeat {r + 1}/{args.repeat} {name}: " +
                  ", ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()), flush=True)

    resolved = sides["sudu"].llm.engine.quantization  # what --quantization auto chose
    fmt = {"none": "fp32"}.get(resolved, resolved)
    per_token = bytes_per_token(ckpt.config, fmt, ckpt)
    print(f"\n{args.model}, sudu --quantization {args.quantization} ({resolved}) --kv-cache-dtype "
          f"{args.kv_cache_dtype}, {args.threads} threads, median of {args.repeat}; llama.cpp batches via llama_batch "
          f"with one seq id per sequence")
    print("| metric (tok/s) | sudu | llama.cpp | sudu / llama.cpp |\n|---|---:|---:|---:|")
    for metric in results["sudu"]:
        s = statistics.median(results["sudu"][metric])
        l = statistics.median(results["llama.cpp"][metric])
        labels = {"decode": "single-stream decode", "prompt": f"prompt processing ({args.prompt_tokens} tokens)"}
        if metric.startswith("decode @"):
            label = f"single-stream decode after a {metric[8:]}-token prompt"
        else:
            label = labels.get(metric) or f"aggregate output, {metric.split()[-1]} sequences"
        print(f"| {label} | {s:.1f} | {l:.1f} | {s / l:.2f}x |")
    fractions = [tps * per_token / (bw * 1e9) for tps, bw in zip(results["sudu"]["decode"], bandwidths)]
    print(f"\nroofline ({fmt}, {per_token / 1e6:.0f} MB/token), each sudu decode run against the bandwidth measured "
          f"right after it:")
    for tps, bw, frac in zip(results["sudu"]["decode"], bandwidths, fractions):
        print(f"  {tps:.1f} tok/s = {tps * per_token / 1e9:.1f} GB/s of weights; bandwidth {bw:.1f} GB/s "
              f"(limit {bw * 1e9 / per_token:.1f} tok/s): {frac:.0%}")
    print(f"  median: sudu decode reaches {statistics.median(fractions):.0%} of the roofline")


if __name__ == "__main__":
    main()
