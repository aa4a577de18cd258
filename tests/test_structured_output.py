"""Structured output in the engine (sudu/structured/) on a tiny random model: a random model writes
whatever its mask allows, so every answer validating is the grammar's doing. JSON schemas (nested
objects, enums, arrays, bounded numbers, required fields) greedy and sampled, regexes, choices, Lark and
GBNF; constrained and free requests in one batch equal to each alone; forced tokens appended without a
model step; speculative decoding on, with the same greedy output; compile errors refused."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from benchmarks.structured_output import random_schema
from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams
from sudu.structured import grammars as G
from sudu.structured.grammars import GrammarError
from sudu.structured.masks import GrammarMasks


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["qwen2"]), progress=False, max_model_len=512, kv_cache_memory=16 << 20,
               max_num_seqs=64)


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["qwen2"]), progress=False, max_model_len=512, kv_cache_memory=16 << 20,
               speculative="ngram")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_always_validate(llm, temperature):
    rng = random.Random(7 if temperature else 3)
    schemas = [random_schema(rng) for _ in range(100)]
    for s in schemas:  # numbers: any digits are valid JSON, but the model must be able to stop
        _cap_numbers(s)
    params = [SamplingParams(temperature=temperature, max_tokens=400, seed=i, grammar=G.json_schema_grammar(s))
              for i, s in enumerate(schemas)]
    outs = llm.generate([[1, 2, 3, 4]] * len(schemas), params)
    for schema, out in zip(schemas, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (schema, o.text)
        jsonschema.validate(json.loads(o.text), schema)


def _cap_numbers(schema: dict) -> None:
    if schema.get("type") == "number":
        schema.pop("type")
        schema.update({"type": "number", "multipleOf": 0.25})
    for sub in list(schema.get("properties", {}).values()) + ([schema["items"]] if "items" in schema else []):
        _cap_numbers(sub)


def test_regex_choice_lark_and_gbnf(llm):
    cases = [
        (G.regex_grammar(r"[a-c]{3}-\d{2,4}"), lambda t: re.fullmatch(r"[a-c]{3}-\d{2,4}", t)),
        (G.choice_grammar(["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
        (G.lark_grammar('start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/\n'),
         lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", t)),
        (G.lark_grammar('root ::= "x" [0-9] [0-9]? "!"\n'), lambda t: re.fullmatch(r"x\d\d?!", t)),
    ]
    for temperature in (0.0, 1.0):
        outs = llm.generate([[5, 6, 7]] * len(cases),
                            [SamplingParams(temperature=temperature, max_tokens=60, seed=1, grammar=g) for g, _ in cases])
        for (_, ok), out in zip(cases, outs):
            assert ok(out.outputs[0].text), out.outputs[0].text


def test_mixed_batch_equals_each_request_alone(llm):
    schema = {"type": "object", "properties": {"a": {"enum": ["p", "q"]}, "b": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["a", "b"], "additionalProperties": False}
    prompts = [[9, 10, 11], [12, 13], [14, 15, 16, 17], [18]]
    params = [SamplingParams(temperature=0, max_tokens=30, grammar=G.json_schema_grammar(schema)),
              SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=30, grammar=G.regex_grammar(r"[xyz]{5}")),
              SamplingParams(temperature=0, max_tokens=30)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert together == alone
    assert together[1] != together[0]  # the free rows were not constrained
    # the other way to compute masks (beside the forward pass, or after it): the same tokens
    engine = llm.engine
    default = engine.grammar_masks
    engine.grammar_masks = GrammarMasks(engine.grammar_backend.vocab_size, overlap=default._pool is None)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == together
    finally:
        engine.grammar_masks.close()
        engine.grammar_masks = default


def test_forced_tokens_are_appended_without_model_steps(llm):
    choice = "the only answer there is, forced to the very end"
    params = SamplingParams(temperature=0, max_tokens=100, grammar=G.choice_grammar([choice]))
    steps = llm.engine.num_steps
    out = llm.generate([[20, 21, 22]], params)[0].outputs[0]
    assert out.text == choice and out.finish_reason == "stop"
    num_tokens = len(out.token_ids)
    assert num_tokens > 5
    # one step for the prompt (its first token forced after it), then the forced tail needs its KV only
    # if the answer continued: it does not, so far fewer steps than tokens
    assert llm.engine.num_steps - steps < num_tokens / 2


def test_forced_tokens_skipped_with_logprobs(llm):
    choice = "abcabcabc"
    params = SamplingParams(temperature=0, max_tokens=50, logprobs=1, grammar=G.choice_grammar([choice]))
    out = llm.generate([[20, 21, 22]], params)[0].outputs[0]
    assert out.text == choice
    assert len(out.logprobs) == len(out.token_ids)


def test_speculative_decoding_keeps_constrained_greedy_output(llm, spec_llm):
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5]
    drafted = 0
    for grammar in (G.regex_grammar("[a-d ]{80}"), G.regex_grammar("[a-z]{10}( [a-z]{1,10}){8}"),
                    G.json_schema_grammar({"type": "object", "properties": {"items": {"type": "array", "items": {
                        "enum": ["ab", "ab ab"]}, "maxItems": 12}}, "required": ["items"]})):
        params = SamplingParams(temperature=0, max_tokens=120, grammar=grammar)
        plain = llm.generate([prompt], params)[0].outputs[0]
        spec_out = spec_llm.generate([prompt], params)[0]
        assert spec_out.outputs[0].token_ids == plain.token_ids
        drafted += spec_out.metrics.num_draft_tokens
    assert drafted > 0  # drafts were proposed, cut to the grammar and verified under its masks


@pytest.mark.parametrize("make, message", [
    (lambda: G.json_schema_grammar({"type": 5}), "type must be"),
    (lambda: G.json_schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "nope"),
    (lambda: G.regex_grammar("a{2,1}"), "repetition"),
    (lambda: G.regex_grammar("[^\\x00-\\U0010FFFF]"), "matches no text"),
    (lambda: G.lark_grammar("start: undefined_rule\n"), "undefined_rule"),
])
def test_bad_grammars_are_refused_at_admission(llm, make, message):
    with pytest.raises(GrammarError, match=message):
        llm.engine.check_request([1, 2], SamplingParams(max_tokens=4, grammar=make()))


def test_tool_call_grammar_output_parses(llm):
    from sudu.tools.parser import parse_tool_calls

    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}},
        {"name": "now"}]
    for parallel in (False, True):
        g = G.tool_calls_grammar(tools, parallel)
        outs = llm.generate([[7, 8]] * 6, [SamplingParams(temperature=1.0, seed=i, max_tokens=300, grammar=g)
                                           for i in range(6)])
        for out in outs:
            content, calls = parse_tool_calls(out.outputs[0].text, "hermes")
            assert content is None and calls, out.outputs[0].text
            assert parallel or len(calls) == 1
            for call in calls:
                args = json.loads(call.arguments)
                if call.name == "get_weather":
                    assert set(args) == {"city", "unit"}
                else:
                    assert call.name == "now" and args == {}
