"""The evaluation behind sudu's grammar engine (docs/structured_output.md, "Why llguidance"): llguidance,
xgrammar and outlines-core on the default model's vocabulary (151,936 ids), one thread each.

For each engine: the time to build its view of the vocabulary; the time to compile a JSON schema; the
CPU time of one token mask (median and p99 over every position of a valid 2,000-character answer,
walked token by token); and JSON-schema coverage: how many of a set of schemas each compiles (random
nested schemas as in tests/test_structured_output.py, plus one schema per JSON-schema feature).

The candidates other than llguidance are not sudu dependencies: install them to run this
(`pip install xgrammar outlines-core`; xgrammar also pulls torch, transformers and triton).

    python -m benchmarks.grammar_engines
"""
from __future__ import annotations

import json
import random
import statistics
import time

from benchmarks import structured_output
from benchmarks.structured_output import random_schema

MODEL = "qwen2.5-coder-0.5b-instruct"
PEOPLE = {**structured_output.PEOPLE, "minItems": 1}
FEATURES = {
    "enum/const": {"type": "object", "properties": {"a": {"enum": ["x", 1, None]}, "b": {"const": "k"}},
                   "required": ["a", "b"]},
    "number bounds": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 10},
    "string pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "string format": {"type": "string", "format": "date-time"},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"required": ["a"]}]},
    "$ref/$defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                   "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}},
    "recursion": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "type array": {"type": ["string", "null"]},
}


def answer_text() -> str:
    rng = random.Random(1)
    people = []
    while len(json.dumps(people, separators=(", ", ": "))) < 2000:
        people.append({"name": "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 20))),
                       "age": rng.randint(0, 120), "city": rng.choice(["Oslo", "Lima", "Pune", "Kyoto"])})
    return json.dumps(people, separators=(", ", ": "))


def _p99(xs):
    return sorted(xs)[int(0.99 * (len(xs) - 1))]


def run_llguidance(tok, vocab_size, eos, answer_ids, schemas):
    import llguidance

    from sudu.structured.grammars import json_schema_grammar

    t0 = time.perf_counter()
    llt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    setup = time.perf_counter() - t0

    def compile_(schema):
        m = llguidance.LLMatcher(llt, json_schema_grammar(schema), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    t0 = time.perf_counter()
    m = compile_(PEOPLE)
    compile_s = time.perf_counter() - t0
    mask = bytearray((vocab_size + 31) // 32 * 4)
    times = []
    for t in answer_ids:
        t0 = time.perf_counter()
        m.compute_mask_into(mask) if hasattr(m, "compute_mask_into") else m.compute_bitmask()
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return setup, compile_s, times, _coverage(compile_, schemas)


def run_xgrammar(tok, vocab_size, eos, answer_ids, schemas):
    import xgrammar as xgr

    vocab = [tok.backend.id_to_token(i) or "" for i in range(vocab_size)]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0

    def compile_(schema):
        return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                               separators=(", ", ": ")))

    t0 = time.perf_counter()
    m = compile_(PEOPLE)
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    times = []
    for t in answer_ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return setup, compile_s, times, _coverage(compile_, schemas)


def run_outlines_core(tok, vocab_size, eos, answer_ids, schemas):
    import outlines_core as oc
    import torch

    from sudu.tokenizer import byte_to_unicode

    unbyte = {c: b for b, c in byte_to_unicode().items()}
    t0 = time.perf_counter()
    mapping: dict[bytes, list[int]] = {}
    for i in range(tok.backend.get_vocab_size(with_added_tokens=True)):
        piece = tok.backend.id_to_token(i)
        if piece is None or i in eos:
            continue
        try:
            raw = bytes(unbyte[c] for c in piece)
        except KeyError:
            raw = piece.encode()
        mapping.setdefault(raw, []).append(i)
    vocab = oc.Vocabulary(eos[0], mapping)
    setup = time.perf_counter() - t0

    def compile_(schema):
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return oc.Guide(oc.Index(regex, vocab))

    t0 = time.perf_counter()
    g = compile_(PEOPLE)
    compile_s = time.perf_counter() - t0
    mask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for t in answer_ids:
        t0 = time.perf_counter()
        g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        times.append(time.perf_counter() - t0)
        g.advance(t)
    return setup, compile_s, times, _coverage(compile_, schemas)


def _coverage(compile_, schemas):
    ok, failed = 0, []
    for name, schema in schemas:
        try:
            compile_(schema)
            ok += 1
        except Exception as exc:  # noqa: BLE001 -- any refusal counts against coverage
            failed.append(f"{name}: {str(exc).splitlines()[0][:60] if str(exc) else type(exc).__name__}")
    return ok, failed


ENGINES = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines-core": run_outlines_core}


def run_one(name: str) -> None:
    import torch

    from sudu.weights.loader import load_checkpoint

    torch.set_num_threads(1)
    ckpt = load_checkpoint(MODEL, pull=True, progress=False)
    tok, vocab_size = ckpt.tokenizer, ckpt.config.vocab_size
    eos = sorted(set(tok.eos_token_ids))
    answer_ids = tok.encode(answer_text(), add_special_tokens=False)
    rng = random.Random(0)
    schemas = [(f"random {i}", random_schema(rng)) for i in range(100)] + list(FEATURES.items())
    try:
        setup, compile_s, times, (ok, failed) = ENGINES[name](tok, vocab_size, eos, answer_ids, schemas)
    except ImportError as exc:
        print(f"| {name} | not installed ({exc.name}) | | | | |")
        return
    print(f"| {name} | {setup:.2f} | {compile_s * 1e3:.1f} | {statistics.median(times) * 1e6:.0f} | "
          f"{_p99(times) * 1e6:.0f} | {ok}/{len(schemas)} |", flush=True)
    for f in failed:
        print(f"    - {name} refused {f}")


def main() -> None:
    import argparse
    import subprocess
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=sorted(ENGINES), help="run one engine in this process")
    ap.add_argument("--timeout", type=float, default=300, help="seconds each engine may take")
    args = ap.parse_args()
    if args.engine:
        run_one(args.engine)
        return
    print(f"# grammar engines on {MODEL}'s vocabulary; a 2,000-character answer walked token by token; "
          f"100 random schemas + {len(FEATURES)} feature schemas; each engine in its own process, "
          f"at most {args.timeout:.0f} s and 12 GiB of address space\n")
    print("| engine | vocabulary setup s | compile (schema) ms | mask p50 us | mask p99 us | schemas compiled |")
    print("|---|---:|---:|---:|---:|---:|", flush=True)
    for name in ENGINES:
        cmd = [sys.executable, "-m", "benchmarks.grammar_engines", "--engine", name]
        try:
            done = subprocess.run(["prlimit", f"--as={12 << 30}", *cmd], capture_output=True, text=True,
                                  timeout=args.timeout)
            print(done.stdout.rstrip() or f"| {name} | failed: {done.stderr.strip().splitlines()[-1][:80]} | | | | |",
                  flush=True)
        except subprocess.TimeoutExpired:
            print(f"| {name} | did not finish in {args.timeout:.0f} s | | | | |", flush=True)


if __name__ == "__main__":
    main()
