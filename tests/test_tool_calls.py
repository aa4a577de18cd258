"""sudu/tools: tool-call parsing, whole and streamed (split at every point, against the whole parse)."""
from __future__ import annotations

import json
import random
import re

import pytest

from sudu.tokenizer import GEMMA_DEFAULT_CHAT_TEMPLATE
from sudu.tools.parser import (ContentDelta, ToolCallArgsDelta, ToolCallStart, ToolCallStreamParser, detect_format,
                               parse_tool_calls)


def calls_of(text: str, fmt: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, fmt)
    return content, [(c.name, c.arguments) for c in calls]


def collect(events: list) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], ids) assembled from stream events, checking their order."""
    content, calls, ids = "", [], []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            content += event.text
        elif isinstance(event, ToolCallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
            ids.append(event.id)
        else:
            assert isinstance(event, ToolCallArgsDelta) and event.index == len(calls) - 1 and event.text
            calls[-1][1] += event.text
    return content, [tuple(c) for c in calls], ids


def stream(pieces, fmt: str) -> list:
    parser = ToolCallStreamParser(fmt)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


HERMES_OUTPUTS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "°C"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Zurich"}}\n</tool_call>',
    '<tool_call>{"arguments": {"q": "a \\"quoted\\" </tool_call> inside"}, "name": "search"}</tool_call> done',
    '<tool_call>\n{"name": "now"}\n</tool_call>',
    '<tool_call>\n{"name":"f","arguments":{ "nested" : {"a": [1, 2.5e3, -3, true, null, {"b": "}"}]} }}',
    'plain answer, no calls 😀 naïve',
    'before <tool_call>\nnot json at all\n</tool_call> after <tool_call>{"name": "ok", "arguments": {}}</tool_call>',
    '<tool_call>{"nam": "f", "arguments": {}}</tool_call><tool_call>{"name": 3}</tool_call>x',
    'x < y and <tool_ca ll> and <tool_call',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',
    '   \n<tool_call>{"name": "👨‍👩‍👧", "arguments": {"emoji": "🇫🇷 e\u0301"}}</tool_call>\n   ',
    '<tool_call>{"arguments": {"a": 1}, "parameters": {"b": 2}, "name": "f"}</tool_call>',
    '<tool_call>{"name": "esc", "arguments": {"s": "\\"}", "t": "a\\\\", "u": "\\u0022}"}}</tool_call>',
]

LLAMA3_OUTPUTS = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": [1, "é"]}}',
    '  \n<|python_tag|>{"name": "f", "parameters": {}}\n<|python_tag|>{"name": "g", "parameters": {"x": "y"}}',
    '{"name": "f", "parameters": {"a": 1}}\nI called f for you.',
    '{"name": "Bob", "age": 3}',
    'The answer is {"name": "f", "parameters": {}}',
    '<|python_tag|>print("hi")',
    '{"parameters": {"z": 0}, "name": "late_name"} ; ',
    '{"name": "f", "parameters": {"a": 1}}; {"name": "g"}',
    '<|python_ta',
]


def test_hermes_whole_parse():
    assert calls_of(HERMES_OUTPUTS[1], "hermes") == ("Let me look that up.", [
        ("get_weather", '{"city": "Zürich", "unit": "°C"}'), ("get_time", '{"tz": "Europe/Zurich"}')])
    # a closing tag inside a string does not end the block; key order does not matter
    assert calls_of(HERMES_OUTPUTS[2], "hermes") == (
        "done", [("search", '{"q": "a \\"quoted\\" </tool_call> inside"}')])
    assert calls_of(HERMES_OUTPUTS[3], "hermes") == (None, [("now", "{}")])
    # arguments are the model's own text, spacing included; an unclosed block at the end still counts
    assert calls_of(HERMES_OUTPUTS[4], "hermes") == (
        None, [("f", '{ "nested" : {"a": [1, 2.5e3, -3, true, null, {"b": "}"}]} }')])
    assert calls_of(HERMES_OUTPUTS[5], "hermes") == ("plain answer, no calls 😀 naïve", [])
    assert calls_of("", "hermes") == (None, [])


def test_hermes_malformed_blocks_stay_in_content():
    assert calls_of(HERMES_OUTPUTS[6], "hermes") == (
        "before <tool_call>\nnot json at all\n</tool_call> after", [("ok", "{}")])
    assert calls_of(HERMES_OUTPUTS[7], "hermes") == (
        '<tool_call>{"nam": "f", "arguments": {}}</tool_call><tool_call>{"name": 3}</tool_call>x', [])
    assert calls_of(HERMES_OUTPUTS[11], "hermes")[1] == []  # two argument objects: ambiguous
    assert calls_of(HERMES_OUTPUTS[12], "hermes")[1] == [("esc", '{"s": "\\"}", "t": "a\\\\", "u": "\\u0022}"}')]
    bad = ['<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # cut off
           '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # NaN is not JSON
           '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "", "arguments": {}}',
           '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
           '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
           '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>']
    for text in bad:
        assert calls_of(text, "hermes") == (text, []), text


def test_llama3_whole_parse():
    assert calls_of(LLAMA3_OUTPUTS[0], "llama3") == (None, [("get_weather", '{"city": "Paris"}')])
    assert calls_of(LLAMA3_OUTPUTS[1], "llama3") == (None, [("f", '{"a": 1}'), ("g", '{"b": [1, "é"]}')])
    assert calls_of(LLAMA3_OUTPUTS[2], "llama3") == (None, [("f", "{}"), ("g", '{"x": "y"}')])
    assert calls_of(LLAMA3_OUTPUTS[3], "llama3") == ("I called f for you.", [("f", '{"a": 1}')])
    # a JSON answer that is not a call, a call not at the start, code for the interpreter: content
    for text in LLAMA3_OUTPUTS[4:7]:
        assert calls_of(text, "llama3") == (text, [])
    assert calls_of(LLAMA3_OUTPUTS[7], "llama3") == (None, [("late_name", '{"z": 0}')])
    assert calls_of(LLAMA3_OUTPUTS[8], "llama3") == ('{"name": "g"}', [("f", '{"a": 1}')])
    # the hermes syntax is not llama3's, and the other way round
    assert calls_of(HERMES_OUTPUTS[0], "llama3")[1] == []
    assert calls_of(LLAMA3_OUTPUTS[0], "hermes")[1] == []


def test_call_ids_are_openai_like_and_distinct():
    _, calls = parse_tool_calls(HERMES_OUTPUTS[1], "hermes")
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert len({c.id for c in calls}) == 2
    assert all(isinstance(json.loads(c.arguments), dict) for c in calls)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown tool call format"):
        parse_tool_calls("x", "xml")
    with pytest.raises(ValueError, match="unknown tool call format"):
        ToolCallStreamParser("xml")


@pytest.mark.parametrize(("fmt", "text"),
                         [("hermes", t) for t in HERMES_OUTPUTS] + [("llama3", t) for t in LLAMA3_OUTPUTS])
def test_stream_equals_whole_parse_at_every_split(fmt, text):
    expected_content, expected_calls = calls_of(text, fmt)
    expected = (expected_content or "", expected_calls)
    assert collect(stream(text, fmt))[:2] == expected  # one character at a time
    for cut in range(len(text) + 1):
        assert collect(stream([text[:cut], text[cut:]], fmt))[:2] == expected, cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert collect(stream(pieces, fmt))[:2] == expected, pieces


CALL_OBJECTS = ['{"name": "f", "arguments": {}}', '{"name":"get_weather","arguments":{"city":"Zürich 🇨🇭"}}',
                '{ "arguments" : {"a": [1, {"b": "x}y"}], "c": "\\"q\\""}, "name" : "g" }', '{"name": "now"}',
                '{"name": "h", "parameters": {"n": -1.5e-3, "t": true, "z": null}, "id": 7}']
NOT_CALLS = ['{"name": 3, "arguments": {}}', '{"nam": "f"}', 'plain words', '{"arguments": [1], "name": "f"}',
             '', '{"arguments": {}, "arguments": {}, "name": "f"}', '[1, 2]', '{"name": "", "arguments": {}}']
TEXTS = ["Hi", " ", "\n\n", "<", "<tool", "</tool_call>", "<tool_call", "é 😀 e\u0301", "a <b> c", "{", "}", ";"]


def random_output(rng: random.Random, fmt: str) -> str:
    """A model output made of calls, text and blocks that are malformed before they could be announced."""
    if fmt == "llama3":
        items = [rng.choice(["", "<|python_tag|>"]) + rng.choice([c for c in CALL_OBJECTS if "now" not in c])
                 for _ in range(rng.randint(0, 3))]
        seps = [rng.choice([";", "; ", "\n", " ;\n", ""]) for _ in items]
        rest = rng.choice([""] + NOT_CALLS + TEXTS) if rng.random() < 0.5 else ""
        return rng.choice(["", " ", "\n"]) + "".join(i + s for i, s in zip(items, seps)) + rest
    parts = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.random()
        if kind < 0.4:
            parts.append(rng.choice(TEXTS))
        elif kind < 0.75:
            parts.append("<tool_call>" + rng.choice(["", "\n"]) + rng.choice(CALL_OBJECTS) +
                         rng.choice(["", "\n"]) + "</tool_call>")
        else:
            parts.append("<tool_call>" + rng.choice(NOT_CALLS) + "</tool_call>")
    if rng.random() < 0.3:
        parts.append("<tool_call>\n" + rng.choice(CALL_OBJECTS) + "\n")  # stopped before the closing tag
    return "".join(parts)


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_stream_equals_whole_parse_on_random_outputs(fmt):
    rng = random.Random(fmt)
    found_calls = 0
    for _ in range(150):
        text = random_output(rng, fmt)
        content, calls = calls_of(text, fmt)
        found_calls += len(calls)
        expected = (content or "", calls)
        assert collect(stream(text, fmt))[:2] == expected, text
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert collect(stream(pieces, fmt))[:2] == expected, pieces
    assert found_calls > 100  # the generator does produce calls


def test_stream_announces_early_and_streams_arguments():
    parser = ToolCallStreamParser("hermes")
    assert parser.feed("Checking <tool_") == [ContentDelta("Checking")]  # the tag's start is held
    assert parser.feed('call>\n{"name": "get_wea') == []
    (start,) = parser.feed('ther"')
    assert isinstance(start, ToolCallStart) and (start.index, start.name) == (0, "get_weather")
    assert parser.feed(', "arguments": {"city": "Pa') == [ToolCallArgsDelta(0, '{"city": "Pa')]
    assert parser.feed('ris"}') == [ToolCallArgsDelta(0, 'ris"}')]
    assert parser.feed("}\n</tool_call>") == []
    assert parser.finish() == []


def test_stream_whitespace_and_ids():
    events = stream(["  \n", "Hi", " \n", "<tool_call>", '{"name": "f"}', "</tool_call>", "\n\n"], "hermes")
    assert [e for e in events if isinstance(e, ContentDelta)] == [ContentDelta("Hi")]
    assert events[-1] == ToolCallArgsDelta(0, "{}")  # no arguments: an empty object, sent at the end
    _, _, ids = collect(stream(HERMES_OUTPUTS[1], "hermes"))
    assert len(ids) == 2 and ids[0] != ids[1] and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    with pytest.raises(ValueError):
        parser = ToolCallStreamParser("hermes")
        parser.finish()
        parser.feed("x")


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_stream_long_output(fmt):
    call = '<tool_call>{"name": "f", "arguments": {"a": "%s"}}</tool_call>' % ("x" * 5000)
    text = "word é " * 2000 + call + " tail" * 1000 + call if fmt == "hermes" else \
        '{"name": "f", "parameters": {"a": "%s"}}' % ("y" * 5000) + "\nthen " * 2000
    content, calls = calls_of(text, fmt)
    assert len(calls) == (2 if fmt == "hermes" else 1)
    assert collect(stream([text[i:i + 3] for i in range(0, len(text), 3)], fmt))[:2] == (content, calls)


def test_stream_llama3_json_answer_is_never_announced():
    events = stream('{"name": "Bob", "age": 3}', "llama3")
    assert events == [ContentDelta('{"name": "Bob", "age": 3}')]


def test_stream_block_malformed_after_its_announcement():
    # the call cannot be taken back; the rest of the block comes out as content, nothing is lost
    text = '<tool_call>{"name": "f", "arguments": [1]}</tool_call> after'
    content, calls, _ = collect(stream(text, "hermes"))
    assert calls == [("f", "")]
    assert content == ', "arguments": [1]}</tool_call> after'
    parser = ToolCallStreamParser("hermes")
    events = parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_')  # junk: decided at once
    assert collect(events)[:2] == ("} junk</tool_", [("f", '{"a": 1}')])
    assert parser.feed("call> more") + parser.finish() == [ContentDelta("call> more")]
    # cut off mid-arguments: what was streamed stays streamed
    content, calls, _ = collect(stream('<tool_call>{"name": "f", "arguments": {"a": 1', "hermes"))
    assert (content, calls) == ("", [("f", '{"a": 1')])


def test_detect_format():
    assert detect_format(None) == "hermes"
    assert detect_format("{{ '<tool_call>' }}") == "hermes"
    assert detect_format("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert detect_format("{{- '<|python_tag|>' }}") == "llama3"
    assert detect_format(GEMMA_DEFAULT_CHAT_TEMPLATE) == "hermes"
