"""Tool calls in tool_choice auto. Bare JSON calls (sudu/tools/bare_calls.py): an answer that begins with a
JSON object naming a known tool, with its required arguments, is that call, whole and streamed at every
cut, on every API; every other answer parses exactly as before. The lazy grammar
(grammars.lazy_tool_calls_grammar): on a tiny model, greedy, an answer that never writes the opening tag is
token for token the free one."""
from __future__ import annotations

import json
import random

import pytest

from sudu.server.answer_events import AnswerEvents, gather
from sudu.tools.bare_calls import leading_call
from sudu.tools.parser import parse_tool_calls

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
         "now": {}}


@pytest.mark.parametrize("text, calls, content", [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', [("get_weather", '{"city": "Oslo"}')], None),
    ('  \n{"name": "now"}', [("now", "{}")], None),
    ('{"arguments": {"city": "Rome"}, "name": "get_weather"} and then', [("get_weather", '{"city": "Rome"}')],
     "and then"),
    ('{"name": "get_weather", "arguments": {"city": "A"}}\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     [("get_weather", '{"city": "A"}'), ("now", "{}")], None),
    # not calls: unknown tool, a required argument missing, plain JSON, plain text, an unclosed object
    ('{"name": "delete_all", "arguments": {}}', [], '{"name": "delete_all", "arguments": {}}'),
    ('{"name": "get_weather", "arguments": {}}', [], '{"name": "get_weather", "arguments": {}}'),
    ('{"answer": 42}', [], '{"answer": 42}'),
    ("The answer is 42.", [], "The answer is 42."),
    ('{"name": "get_weather", "arguments": {"city": "Os', [], '{"name": "get_weather", "arguments": {"city": "Os'),
    ('x {"name": "now"}', [], 'x {"name": "now"}'),
])
def test_bare_calls_whole_and_streamed(text, calls, content):
    bare, rest = leading_call(text, TOOLS)
    rest_content, rest_calls = parse_tool_calls(rest, "hermes")
    whole = ([(bare.name, bare.arguments)] if bare else []) + [(c.name, c.arguments) for c in rest_calls]
    assert whole == calls and rest_content == content
    if not calls:  # no bare call: exactly the parse without the rule
        assert parse_tool_calls(text, "hermes")[0] == content
    rng = random.Random(1)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
        events = AnswerEvents("hermes", False, False, TOOLS)
        got = []
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            got += events.feed(text[a:b])
        answer = gather(got + events.finish(), False)
        assert [(n, a) for _, n, a in answer.calls] == calls and answer.content == content
        assert events.called == bool(calls)
        for name, arguments in calls:
            json.loads(arguments)


def test_ordinary_answers_are_held_only_while_ambiguous():
    events = AnswerEvents("hermes", False, False, TOOLS)
    assert [e.text for e in events.feed("Sure")] == ["Sure"]
    events = AnswerEvents("hermes", False, False, TOOLS)
    assert events.feed('{"answer"') == [] and events.feed(": 1") == []
    assert [e.text for e in events.feed("} done")] == ['{"answer": 1} done']
    events = AnswerEvents("hermes", False, False, TOOLS)
    assert events.feed("{") == [] and [e.text for e in events.feed("oops")] == ["{oops"]
    events = AnswerEvents("hermes", False, False, None)  # without the rule (tool_choice other than auto)
    assert [e.text for e in events.feed('{"name": "now"}')] == ['{"name": "now"}']


# ---------------------------------------------------------------- on every API, with the echoing fake engine


class EchoTokenizer:
    """The fake engine answers a prompt with its own bytes: rendering only the last message makes the
    answer exactly the user's text."""

    @staticmethod
    def make():
        from tests.helpers.fake_engine import ByteTokenizer

        class Echo(ByteTokenizer):
            def encode_chat(self, messages, add_generation_prompt=True, max_tokens=None, tools=None,
                            template_kwargs=None):
                return self.encode(messages[-1]["content"], max_tokens=max_tokens)

        return Echo()


BARE = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


@pytest.fixture(scope="module")
def echo():
    from sudu.server.app import build_app
    from tests.helpers.fake_engine import FakeEngine
    from tests.helpers.live_server import LiveServer

    engine = FakeEngine(step_s=0.0005)
    engine.tokenizer = EchoTokenizer.make()
    with LiveServer(build_app(engine, served_model_name="m")) as server:
        yield server


def test_bare_call_on_every_api(echo):
    import anthropic
    import openai

    from tests.helpers.live_server import collect_stream

    oai = openai.OpenAI(base_url=echo.url + "/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    ask = dict(model="m", messages=[{"role": "user", "content": BARE}], tools=tools, max_tokens=len(BARE))
    msg = oai.chat.completions.create(**ask).choices[0].message
    assert msg.content is None and [(c.function.name, c.function.arguments) for c in msg.tool_calls] == \
        [("get_weather", '{"city": "Oslo"}')]
    content, calls, _ = collect_stream(oai.chat.completions.create(stream=True, **ask))
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    forced = oai.chat.completions.create(**{**ask, "tool_choice": "none"}).choices[0].message
    assert forced.content == BARE and not forced.tool_calls  # the rule is for tool_choice auto only

    claude = anthropic.Anthropic(base_url=echo.url, api_key="x", max_retries=0)
    answer = claude.messages.create(model="m", max_tokens=len(BARE), messages=[{"role": "user", "content": BARE}],
                                    tools=[{"name": n, "input_schema": p or {"type": "object"}} for n, p in TOOLS.items()])
    assert [(b.type, b.name, b.input) for b in answer.content] == [("tool_use", "get_weather", {"city": "Oslo"})]

    r = oai.responses.create(model="m", input=BARE, max_output_tokens=len(BARE),
                             tools=[{"type": "function", "name": n, "parameters": p or None} for n, p in TOOLS.items()])
    assert [(i.type, i.name, i.arguments) for i in r.output] == [("function_call", "get_weather", '{"city": "Oslo"}')]


# ---------------------------------------------------------------- the lazy grammar, in the engine


def test_lazy_grammar_leaves_free_text_unchanged(tiny_model_dirs):
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams
    from sudu.structured import grammars as G

    llm = LLM(str(tiny_model_dirs["llama"]), progress=False, max_model_len=512, kv_cache_memory=8 << 20)
    prompt = llm.tokenizer.encode("def add(a, b):\n    return a + b\n", add_special_tokens=False)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].outputs[0]
    ids = list(free.token_ids)
    stops = set(llm.tokenizer.eos_token_ids)  # the tags must be ordinary tokens the grammar can force
    k = next(i for i in range(4, len(ids))  # a token the free answer writes first at k
             if ids[i] not in ids[:i] and ids[i] not in stops and not llm.tokenizer.is_special(ids[i]))
    opening = ids[k]
    closing = next(t for t in range(10, llm.tokenizer.vocab_size)
                   if t not in ids and t not in stops and not llm.tokenizer.is_special(t))
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    # without the tag in the answer the grammar changes nothing
    never = G.lazy_tool_calls_grammar([{"name": "get_weather", "parameters": schema}], closing, opening)
    same = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                 grammar=never))[0].outputs[0]
    assert list(same.token_ids) == ids
