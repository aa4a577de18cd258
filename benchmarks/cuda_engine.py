"""sudu on a CUDA GPU next to transformers on the same GPU, same weights, same dtype (bfloat16), one run.

The GPU machine reaches no network and the catalog's GGUFs are too large to carry to it, so both sides run
the same randomly initialised network in the exact shapes of the catalog's Qwen2.5-Coder 0.5B / 1.5B, with
the real tokenizer (decode and prefill cost do not depend on the weights' values). Greedy outputs are
compared anyway: both must compute the same network.

Step 1, where the catalog's GGUFs are (this CPU machine):
    python -m benchmarks.cuda_engine prepare --out .devicebench
  writes per model a directory with config.json and the tokenizer (tokenizer.json, tokenizer_config.json).
Step 2, on the GPU machine:
    python -m benchmarks.cuda_engine run --assets .devicebench [--models qwen2.5-coder-0.5b-instruct,...] [--repeat 3]

Measures, per side (the two alternate within each repeat; median of --repeat, [min-max]):
  decode    single-stream greedy tok/s: (N - 1) / (t(N new tokens) - t(1 new token)), 32-token prompt
  prompt    prompt processing tok/s on a 512-token prompt: 512 / t(1 new token)
  batch B   aggregate output tok/s, B distinct 32-token prompts, N new tokens each: B * N / wall time
Every call gets fresh random prompts (sudu's prefix cache is off too), so no side reuses a cached prompt.
The decode limit printed next to it is bytes of weights read per token / the GPU's copy bandwidth (measured).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

MODELS = ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]


def prepare(out: Path, models: list[str]) -> None:
    """config.json (Hugging Face form, from the GGUF's metadata) and the tokenizer for each model."""
    from sudu.weights.loader import load_checkpoint

    for name in models:
        ckpt = load_checkpoint(name, pull=True, progress=True)
        c = ckpt.config
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        config = {
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_word_embeddings,
            "hidden_act": c.hidden_act, "eos_token_id": c.eos_token_id, "torch_dtype": "bfloat16",
        }
        (d / "config.json").write_text(json.dumps(config, indent=1))
        tok = ckpt.tokenizer
        tok.backend.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": tok.eos_token}))
        print(f"wrote {d}", flush=True)


def random_prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, vocab - 1000) for _ in range(length)] for _ in range(n)]


DEVICE = "cuda"  # --device cpu: a dry run of this script on a machine without a GPU


def sync_time() -> float:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


class HF:
    name = "transformers"

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts, device=DEVICE)  # equal lengths: no padding
        t0 = sync_time()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)
        return sync_time() - t0, out[:, ids.shape[1]:].tolist()


class Sudu:
    name = "sudu"

    def __init__(self, path: Path, max_seqs: int, **engine):
        from sudu.engine.llm import LLM

        self.llm = LLM(str(path), progress=False, device=DEVICE, dtype="bfloat16", enable_prefix_caching=False,
                       max_num_seqs=max_seqs, kv_cache_memory=8 << 30, **engine)

    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        from sudu.sampling import SamplingParams

        t0 = sync_time()
        results = self.llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return sync_time() - t0, [r.token_ids for r in results]


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        t0 = sync_time()
        b.copy_(a)
        times.append(sync_time() - t0)
    return 2 * a.numel() / statistics.median(times[2:]) / 1e9


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):9.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def random_model(path: Path):
    """(config, transformers model, directory sudu loads): seeded random bf16 weights in the shapes of
    path's config.json, saved with path's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(DEVICE):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    weights = Path("/tmp") / f"sudu-cuda-bench-{path.name}"
    weights.mkdir(exist_ok=True)
    hf.save_pretrained(weights, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (weights / f).write_bytes((path / f).read_bytes())
    print(f"[{path.name}] random bf16 weights built and saved in {time.perf_counter() - t0:.0f} s", flush=True)
    return cfg, hf, weights


def bench_model(path: Path, args, rng: random.Random, bw_gbs: float) -> dict:
    cfg, hf, weights = random_model(path)
    sides = [Sudu(weights, max(args.batches + [1])), HF(hf)]
    vocab, n = cfg.vocab_size, args.tokens
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    if not cfg.tie_word_embeddings:
        weight_bytes -= hf.get_input_embeddings().weight.numel() * 2  # one embedding row is read, not all
    rows: dict[str, dict[str, list[float]]] = {s.name: {} for s in sides}
    agree = []
    for side in sides:  # warm-up at every measured shape (a 4-token warm-up left the first repeat 3x slow)
        side.generate(random_prompts(1, 32, vocab, rng), n)
        side.generate(random_prompts(1, 512, vocab, rng), 1)
        for bsz in args.batches:
            side.generate(random_prompts(bsz, 32, vocab, rng), n)
    for r in range(args.repeat):
        same_prompt = random_prompts(1, 32, vocab, rng)
        outs = {}
        for side in sides:
            t1, _ = side.generate(same_prompt, 1)
            tn, toks = side.generate(same_prompt, n)
            outs[side.name] = toks[0]
            rows[side.name].setdefault("decode", []).append((n - 1) / (tn - t1))
            t512, _ = side.generate(random_prompts(1, 512, vocab, rng), 1)
            rows[side.name].setdefault("prompt512", []).append(512 / t512)
            for b in args.batches:
                tb, _ = side.generate(random_prompts(b, 32, vocab, rng), n)
                rows[side.name].setdefault(f"batch{b}", []).append(b * n / tb)
        a, h = outs["sudu"], outs["transformers"]
        agree.append(next((i for i, (x, y) in enumerate(zip(a, h)) if x != y), len(a)))
        print(f"[{path.name}] repeat {r + 1}/{args.repeat} done", flush=True)
    limit = bw_gbs * 1e9 / 2 / weight_bytes  # a copy reads and writes: decode only reads
    print(f"\n{path.name}: bf16 weights {weight_bytes / 1e9:.2f} GB read per token; decode limit at the copy "
          f"bandwidth ({bw_gbs / 2:.0f} GB/s read) {limit:.0f} tok/s")
    print(f"{'metric':12} {'sudu':>24} {'transformers':>24} {'sudu/transformers':>18}")
    for key in rows["sudu"]:
        s, h = rows["sudu"][key], rows["transformers"][key]
        print(f"{key:12} {fmt(s):>24} {fmt(h):>24} {statistics.median(s) / statistics.median(h):17.2f}x")
    print(f"greedy tokens identical to transformers before the first difference: {agree} of {n} "
          "(bf16 on both sides, different kernels: a near-tie may flip)")
    del sides, hf
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {"model": path.name, "weight_bytes": weight_bytes, "decode_limit_tok_s": limit, "rows": rows,
            "first_difference": agree}


def profile(args) -> None:
    """Where a batch's time goes: sudu at each batch size with the scheduler's auto prompt chunk and with a
    fixed one (steps, ms per step), then cProfile and torch.profiler of one batch."""
    import cProfile
    import pstats

    from sudu.sampling import SamplingParams

    global DEVICE
    DEVICE = args.device
    cfg, hf, weights = random_model(Path(args.assets) / args.models.split(",")[0])
    del hf
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llms = {chunk: Sudu(weights, 64, prefill_chunk_when_decoding=chunk).llm for chunk in args.chunks}

    def once(llm, b):
        eng = llm.engine
        s0, t0 = eng.num_steps, sync_time()
        llm.generate(random_prompts(b, 32, cfg.vocab_size, rng), params)
        dt = sync_time() - t0
        return dt, eng.num_steps - s0

    for llm in llms.values():
        once(llm, 4)
    for b in args.batches:
        for chunk, llm in llms.items():
            dt, steps = once(llm, b)
            print(f"batch {b:3} chunk {chunk or 'auto':>4}: {b * args.tokens / dt:8.1f} tok/s, {steps} steps, "
                  f"{1000 * dt / steps:.2f} ms/step", flush=True)
    if not args.trace:
        return
    llm, b = llms[args.chunks[-1]], max(args.batches)
    pr = cProfile.Profile()
    pr.enable()
    once(llm, b)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    if DEVICE == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile

        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once(llm, b)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def run(args) -> None:
    global DEVICE
    DEVICE = args.device
    rng = random.Random(0)
    name = torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else "cpu (dry run)"
    bw = copy_bandwidth_gbs()
    print(f"{name}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s (read + write)", flush=True)
    results = [bench_model(Path(args.assets) / m, args, rng, bw) for m in args.models.split(",")]
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__,
                                               "copy_gbs": bw, "models": results}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", default=".devicebench")
    p.add_argument("--models", default=",".join(MODELS))
    r = sub.add_parser("run")
    r.add_argument("--assets", default=".devicebench")
    r.add_argument("--models", default=",".join(MODELS))
    r.add_argument("--tokens", type=int, default=128)
    r.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    r.add_argument("--repeat", type=int, default=3)
    r.add_argument("--json", default=None, help="also write the figures here")
    r.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (slow, no figures)")
    q = sub.add_parser("profile")
    for name, default in (("--assets", ".devicebench"), ("--models", MODELS[0]), ("--device", "cuda")):
        q.add_argument(name, default=default)
    q.add_argument("--tokens", type=int, default=128)
    q.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    q.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[0, 512],
                   help="prefill_chunk_when_decoding per engine, built and run in this order (0 = auto)")
    q.add_argument("--trace", action="store_true", help="then cProfile and torch.profiler one batch")
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(Path(args.out), args.models.split(","))
    elif args.cmd == "profile":
        profile(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
