"""`sudu generate MODEL PROMPT`: stream one completion to the terminal through the engine."""
from __future__ import annotations

import argparse
import sys
import time

from sudu.config import add_engine_args, engine_config_from_args


def register_cli(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion of one prompt to the terminal",
                       description="Stream a completion of PROMPT from MODEL (a catalog name, a .gguf "
                                   "file or a Hugging Face-style directory).")
    p.add_argument("model_arg", metavar="MODEL", help="model name or path (see `sudu models list`)")
    p.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stats", action="store_true", help="print timing to stderr at the end")
    add_engine_args(p, skip=("model",))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sudu.engine.llm_engine import LLMEngine
    from sudu.sampling import SamplingParams

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(engine_config_from_args(args, model=args.model_arg))
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        prompt_ids = engine.tokenizer.encode_chat(messages)
    else:
        prompt_ids = engine.tokenizer.encode(prompt)
    t0 = time.perf_counter()
    engine.add_request("cli", prompt_ids, params)
    n_out, finish = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            for o in out.outputs:
                sys.stdout.write(o.text)
                sys.stdout.flush()
                n_out, finish = o.num_output_tokens, o.finish_reason or finish
            metrics = out.metrics
    sys.stdout.write("\n")
    if args.stats:
        elapsed = time.perf_counter() - t0
        ttft = metrics.first_token_time - t0 if metrics.first_token_time else float("nan")
        decode_tps = (n_out - 1) / metrics.decode_s if n_out > 1 and metrics.decode_s > 0 else float("nan")
        print(f"[{len(prompt_ids)} prompt tokens, {n_out} generated, finish={finish}; TTFT {ttft:.3f} s, "
              f"decode {decode_tps:.2f} tok/s, total {elapsed:.2f} s]", file=sys.stderr)
    return 0
