"""Greedy tokens and logprobs of catalog models, recorded to a JSON file, or compared with an earlier record: the
proof that a change which should not touch numerics (a refactor) did not.

    python -m benchmarks.record_outputs record --out /tmp/base.json            # at the base commit
    python -m benchmarks.record_outputs record --out /tmp/head.json            # at the change
    python -m benchmarks.record_outputs compare /tmp/base.json /tmp/head.json  # exit 1 on any difference

Each model runs the same prompts alone, greedy, with the top logprobs of every token; `compare` requires the
tokens and every logprob to be equal bit for bit (floats are recorded with repr, so equal means equal).
"""
from __future__ import annotations

import argparse
import json
import sys

PROMPTS = [
    "Write a haiku about caches.",
    "def fizzbuzz(n):",
    "Explain what a paged KV cache is in two sentences.",
    "List three prime numbers greater than 100.",
]


def record(models: list[str], max_tokens: int) -> dict:
    from sudu import LLM, SamplingParams

    out = {}
    for model in models:
        print(f"record: {model}", file=sys.stderr, flush=True)
        llm = LLM(model, progress=False)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
        runs = []
        for prompt in PROMPTS:  # alone, one at a time: a record of the model, not of batching
            result = llm.generate([prompt], params)[0].outputs[0]
            runs.append({
                "prompt": prompt,
                "token_ids": list(result.token_ids),
                "logprobs": [[repr(lp.logprob)] + [[t, repr(v)] for t, _, v in lp.top] for lp in result.logprobs],
            })
        out[model] = runs
        del llm
    return out


def compare(a: dict, b: dict) -> list[str]:
    diffs = []
    for model in sorted(set(a) | set(b)):
        if model not in a or model not in b:
            diffs.append(f"{model}: recorded on one side only")
            continue
        for ra, rb in zip(a[model], b[model]):
            if ra["token_ids"] != rb["token_ids"]:
                first = next((i for i, (x, y) in enumerate(zip(ra["token_ids"], rb["token_ids"])) if x != y),
                             min(len(ra["token_ids"]), len(rb["token_ids"])))
                diffs.append(f"{model} {ra['prompt']!r}: tokens differ from index {first}")
            elif ra["logprobs"] != rb["logprobs"]:
                first = next(i for i, (x, y) in enumerate(zip(ra["logprobs"], rb["logprobs"])) if x != y)
                diffs.append(f"{model} {ra['prompt']!r}: logprobs differ from index {first}")
    return diffs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--models", default="qwen2.5-coder-0.5b-instruct,gemma-3-270m,qwen2.5-coder-1.5b-instruct")
    rec.add_argument("--max-tokens", type=int, default=32)
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    args = parser.parse_args(argv)
    if args.cmd == "record":
        with open(args.out, "w") as f:
            json.dump(record(args.models.split(","), args.max_tokens), f)
        return 0
    with open(args.a) as fa, open(args.b) as fb:
        diffs = compare(json.load(fa), json.load(fb))
    for d in diffs:
        print(d)
    n = sum(len(v) for v in json.load(open(args.a)).values())
    print(f"{n - len(diffs)} of {n} generations identical (tokens and logprobs)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
