"""Structured output benchmarks (docs/structured_output.md), on the default model, in one process.

1. overhead: decode speed of JSON-schema-constrained generation against free generation, same prompt,
   same number of output tokens (the schema demands a long array, free generation ignores EOS), greedy,
   at batch 1 and 8. Constrained runs twice: masks only (forced tokens off, so every token is a model
   step: the cost of the grammar per token) and as served (forced tokens appended without a step).
   Target: masks-only overhead <= 5%.
2. speculation: n-gram speculative decoding on JSON output (a list of records repeats its keys), against
   plain constrained decoding; greedy outputs must be identical.
3. validity: 200 JSON-schema requests (random nested objects, enums, arrays, bounded numbers, required
   fields; 100 greedy, 100 sampled) through the engine, each answer parsed and validated with jsonschema.

    python -m benchmarks.structured_output [--parts overhead,speculation,validity] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

MODEL = "qwen2.5-coder-0.5b-instruct"
PEOPLE = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"], "additionalProperties": False}}
ASK = "List people as a JSON array of objects with keys name, age and city."


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


class ForwardClock:
    """Seconds the engine spends in its forward passes (ModelRunner.execute), so that the rest of a step's
    time, where every cost of a grammar lands, can be told apart from the forward pass's own drift."""

    def __init__(self, llm):
        self.calls: list[float] = []
        runner = llm.engine.runner
        execute = runner.execute

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return execute(*args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - t0)

        runner.execute = timed


def _decode(llm, clock, prompts, params) -> tuple[float, float, list]:
    """(decode seconds per output token, of which outside the forward pass, outputs). Prefill excluded:
    each sequence's first token comes at the end of its prefill."""
    clock.calls = []
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    total = time.perf_counter() - t0
    prefill = max(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    forward = sum(clock.calls[1:])  # the first pass is the prompts' (all admitted in one step), in `prefill`
    return (total - prefill) / tokens, (total - prefill - forward) / tokens, outs


def _decode_rate(llm, prompts, params) -> tuple[float, list]:
    """Output tokens per second of decoding, and the outputs."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    total = time.perf_counter() - t0
    prefill = max(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return tokens / (total - prefill), outs


def _median_rates(llm, prompts, configs: dict, repeats: int) -> dict:
    """Median result of each config over `repeats` rounds, the configs interleaved within each round so
    that a drift in the machine's speed falls on all of them alike."""
    rates = {name: [] for name in configs}
    for _ in range(repeats):
        for name, run in configs.items():
            rates[name].append(run())
    return {name: statistics.median(r) for name, r in rates.items()}


def part_overhead(llm, repeats: int) -> None:
    from sudu.sampling import SamplingParams
    from sudu.structured import masks
    from sudu.structured.grammars import json_schema_grammar

    print("\n## 1. per-token overhead of constrained decoding (greedy, 256 output tokens per sequence)", flush=True)
    grammar = json_schema_grammar(PEOPLE)
    n_tokens = 256
    free = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=n_tokens, grammar=grammar)
    forced_limit = masks.MAX_FORCED_TOKENS
    clock = ForwardClock(llm)

    def masks_only(prompts):
        masks.MAX_FORCED_TOKENS = 0
        try:
            per_token, outside, outs = _decode(llm, clock, prompts, constrained)
        finally:
            masks.MAX_FORCED_TOKENS = forced_limit
        assert all(len(o.outputs[0].token_ids) == n_tokens for o in outs), "constrained runs stopped early"
        return per_token, outside

    print(f"medians of {repeats} interleaved rounds. ms/token: decode time per output token; outside: the part "
          "of it spent outside the forward pass (scheduling, sampling, and every cost of the grammar); "
          "overhead = the constrained run's extra ms outside the forward pass / the free run's ms/token\n")
    print("| batch | free ms/token | free outside | masks only ms/token | masks only outside | grammar overhead "
          "| end to end | as served ms/token | as served vs free |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (1, 8):
        prompts = [_prompt(llm.tokenizer, f"{ASK} Batch member {i}.") for i in range(batch)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm up
        rounds = {"free": [], "masked": [], "served": []}
        for _ in range(repeats):
            rounds["free"].append(_decode(llm, clock, prompts, free)[:2])
            rounds["masked"].append(masks_only(prompts))
            rounds["served"].append(_decode(llm, clock, prompts, constrained)[:2])
        med = {k: (statistics.median(v[0] for v in r), statistics.median(v[1] for v in r)) for k, r in rounds.items()}
        (f_tok, f_out), (m_tok, m_out), (s_tok, _) = med["free"], med["masked"], med["served"]
        print(f"| {batch} | {1e3 * f_tok:.2f} | {1e3 * f_out:.2f} | {1e3 * m_tok:.2f} | {1e3 * m_out:.2f} | "
              f"{100 * (m_out - f_out) / f_tok:+.1f}% | {100 * (m_tok / f_tok - 1):+.1f}% | {1e3 * s_tok:.2f} | "
              f"{f_tok / s_tok:.2f}x faster |", flush=True)


def part_speculation(llm, spec_llm, repeats: int) -> None:
    from sudu.sampling import SamplingParams
    from sudu.structured.grammars import json_schema_grammar

    print("\n## 2. n-gram speculation on JSON output (greedy, constrained, batch 1)", flush=True)
    schema = dict(PEOPLE, minItems=1, maxItems=12)
    params = SamplingParams(temperature=0, max_tokens=400, grammar=json_schema_grammar(schema))
    prompts = [_prompt(llm.tokenizer, f"{ASK} Twelve people from {city}.") for city in ("Oslo", "Lima", "Pune")]
    print("| prompt | tokens | plain tok/s | n-gram tok/s | speed-up | acceptance | same output |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for i, p in enumerate(prompts):
        runs = {}

        def timed(engine, key):
            rate, outs = _decode_rate(engine, [p], params)
            runs[key] = outs
            return rate

        r = _median_rates(llm, [p], {"plain": lambda: timed(llm, "plain"), "spec": lambda: timed(spec_llm, "spec")},
                          repeats)
        plain, spec = runs["plain"], runs["spec"]
        m = spec[0].metrics
        same = plain[0].outputs[0].token_ids == spec[0].outputs[0].token_ids
        print(f"| {i} | {len(plain[0].outputs[0].token_ids)} | {r['plain']:.1f} | {r['spec']:.1f} | "
              f"{r['spec'] / r['plain']:.2f}x | {m.acceptance_rate:.2f} | {same} |", flush=True)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kind = rng.choice(["object", "object", "enum", "array", "integer", "number", "string", "boolean"]
                      if depth < 2 else ["enum", "integer", "number", "string", "boolean"])
    if kind == "object":
        keys = rng.sample(["id", "name", "title", "score", "tags", "owner", "status", "size", "meta", "items"],
                          rng.randint(1, 4))
        props = {k: random_schema(rng, depth + 1) for k in keys}
        return {"type": "object", "properties": props, "required": [k for k in keys if rng.random() < 0.7],
                "additionalProperties": False}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "open", "closed", "x y", "ünï", 3, None, True],
                                   rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1, "maxItems": 3}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(4, 24)}
    return {"type": "boolean"}


def part_validity(llm) -> None:
    import jsonschema

    from sudu.sampling import SamplingParams
    from sudu.structured.grammars import json_schema_grammar

    print("\n## 3. 200 JSON-schema requests: parse + validate (jsonschema)", flush=True)
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(100)]
    for temperature in (0.0, 0.8):
        prompts = [_prompt(llm.tokenizer, "Answer with one JSON value for this schema: " + json.dumps(s))
                   for s in schemas]
        params = [SamplingParams(temperature=temperature, seed=i, max_tokens=600, grammar=json_schema_grammar(s))
                  for i, s in enumerate(schemas)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        valid, reasons = 0, {}
        for schema, out in zip(schemas, outs):
            o = out.outputs[0]
            reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
            try:
                jsonschema.validate(json.loads(o.text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                print(f"  INVALID ({o.finish_reason}): {o.text[:120]!r}: {str(exc)[:120]}")
        print(f"temperature {temperature}: {valid}/{len(schemas)} valid, finish reasons {reasons}, "
              f"{sum(len(o.outputs[0].token_ids) for o in outs)} tokens in {seconds:.1f} s", flush=True)


def main() -> None:
    from sudu.engine.llm import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="overhead,speculation,validity")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    parts = {p.strip() for p in args.parts.split(",")}
    llm = LLM(MODEL, speculative="none", progress=False, kv_cache_memory=2 << 30)
    if "overhead" in parts:
        part_overhead(llm, args.repeats)
    if "speculation" in parts:
        spec_llm = LLM(MODEL, progress=False, kv_cache_memory=2 << 30, speculative="ngram")
        part_speculation(llm, spec_llm, args.repeats)
        spec_llm.close()
    if "validity" in parts:
        part_validity(llm)
    llm.close()


if __name__ == "__main__":
    main()
