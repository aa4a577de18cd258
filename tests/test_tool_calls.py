"""sudu/tools: tool-call parsing (whole and streamed, split at every point) and the chat-message side
(the real Qwen 2.5 template renders a tool loop; the Gemma default template takes the fallback)."""
from __future__ import annotations

import json
import random
import re

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models

from sudu.errors import SuduError
from sudu.tokenizer import CHATML_DEFAULT_CHAT_TEMPLATE, GEMMA_DEFAULT_CHAT_TEMPLATE, Tokenizer
from sudu.tools import (ContentDelta, ToolCallArgsDelta, ToolCallStart, ToolCallStreamParser, check_tool_choice,
                        check_tool_messages, check_tools, detect_format, fallback_messages,
                        parse_tool_calls, supports_tools, template_messages)


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
    # a piece that already shows the block malformed is never announced: it is content, as in the whole parse
    events = parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_')
    assert collect(events)[:2] == ('<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_', [])
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


# messages

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}


def tool_loop() -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 °C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    ]


def test_template_messages_shapes_tool_calls():
    messages = tool_loop()
    shaped = template_messages(messages)
    assert shaped[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert shaped[2]["tool_calls"][1]["function"] == {"name": "get_time", "arguments": {}}
    assert [shaped[3]["name"], shaped[4]["name"]] == ["get_weather", "get_time"]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched
    assert "name" not in messages[3]
    named = dict(messages[3], name="custom")
    assert template_messages(messages[:3] + [named])[3]["name"] == "custom"
    messages[2]["tool_calls"][1]["function"]["arguments"] = "{'a': 1}"
    with pytest.raises(ValueError, match=r"messages\[2\]\.tool_calls\[1\]\.function\.arguments is not valid JSON"):
        template_messages(messages)


def _qwen_tokenizer() -> Tokenizer:
    from sudu.weights.catalog import cached_path, get_entry, is_pulled
    from sudu.weights.gguf import open_gguf

    entry = get_entry("qwen2.5-coder-0.5b-instruct")
    if not is_pulled(entry):
        pytest.skip("qwen2.5-coder-0.5b-instruct is not in the model cache")
    return Tokenizer.from_gguf(open_gguf(cached_path(entry)))


@pytest.mark.slow
def test_qwen_template_renders_a_tool_loop():
    tok = _qwen_tokenizer()
    assert supports_tools(tok.chat_template) and detect_format(tok.chat_template) == "hermes"
    tools = [WEATHER_TOOL, TIME_TOOL]
    text = tok.apply_chat_template(template_messages(tool_loop()), tools=tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n" in text
    assert ("<|im_start|>assistant\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n18 °C, sunny\n</tool_response>\n"
                         "<tool_response>\n14:05\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # what the template shows the model as its own calls parses back to the same calls
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert calls_of(turn, "hermes") == (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])


def _gemma_like_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<start_of_turn>": 3, "<end_of_turn>": 4}
    backend = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], pad_token_id=None, chat_template=None,
                     add_bos=False)


def test_supports_tools():
    assert not supports_tools(None)
    assert not supports_tools(GEMMA_DEFAULT_CHAT_TEMPLATE)
    assert not supports_tools(CHATML_DEFAULT_CHAT_TEMPLATE)
    assert supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ message.tool_calls }}")


def test_gemma_default_template_takes_the_fallback():
    tok = _gemma_like_tokenizer()
    messages = tool_loop() + [{"role": "assistant", "content": "Sunny, 18 °C, 14:05."},
                              {"role": "user", "content": "Thanks"}]
    with pytest.raises(SuduError, match="alternate"):
        tok.apply_chat_template(messages)  # the raw tool turns break Gemma's alternation
    fallback = fallback_messages(messages, [WEATHER_TOOL, TIME_TOOL])
    assert [m["role"] for m in fallback] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert all("tool_calls" not in m for m in fallback)
    text = tok.apply_chat_template(fallback)
    first_user = text.split("<start_of_turn>user\n")[1].split("<end_of_turn>")[0]
    assert first_user.startswith("Be brief.\n\n# Tools\n")
    assert json.dumps(TIME_TOOL) in first_user and first_user.endswith("</tool_call>\n\nWeather and time in Paris?")
    assert ("<start_of_turn>user\n<tool_response>\n18 °C, sunny\n</tool_response>\n"
            "<tool_response>\n14:05\n</tool_response><end_of_turn>") in text
    model_turn = text.split("<start_of_turn>model\n")[1].split("<end_of_turn>")[0]
    assert calls_of(model_turn, "hermes") == (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])


def test_fallback_messages_system_and_merging():
    messages = [{"role": "user", "content": "hi"}]
    fallback = fallback_messages(messages, [TIME_TOOL])
    assert fallback[0]["role"] == "system" and fallback[0]["content"].startswith("# Tools")
    assert fallback[1:] == messages
    assert fallback_messages(messages, None) == messages
    loop = tool_loop()
    loop[2]["content"] = "Looking."
    loop.append({"role": "user", "content": "And tomorrow?"})
    fallback = fallback_messages(loop, [])
    assert fallback[2]["content"].startswith("Looking.\n<tool_call>\n")
    assert fallback[3] == {"role": "user", "content": "<tool_response>\n18 °C, sunny\n</tool_response>\n"
                                                      "<tool_response>\n14:05\n</tool_response>\n\nAnd tomorrow?"}
    assert len(fallback) == 4


# validation

def test_check_tools():
    check_tools([WEATHER_TOOL, TIME_TOOL])
    check_tools(None)
    bad = [
        ([], "non-empty list"),
        ({"type": "function"}, "non-empty list"),
        ([{"type": "retrieval"}], r"tools\[0\]: only"),
        ([{"type": "function"}], r"tools\[0\]\.function must be"),
        ([{"type": "function", "function": {"name": "has space"}}], "1 to 64 letters"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "1 to 64 letters"),
        ([WEATHER_TOOL, WEATHER_TOOL], r"tools\[1\]: the function name 'get_weather'"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "type.*object"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "JSON schema object"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], "description"),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "strict"),
    ]
    for tools, message in bad:
        with pytest.raises(ValueError, match=message):
            check_tools(tools)


def test_check_tool_choice():
    tools = [WEATHER_TOOL, TIME_TOOL]
    for choice in (None, "none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        check_tool_choice(choice, tools)
    check_tool_choice("auto", None)
    check_tool_choice("none", None)
    bad = [
        ("required", None, "needs tools"),
        ({"type": "function", "function": {"name": "get_time"}}, None, "no tools"),
        ({"type": "function", "function": {"name": "missing"}}, tools, "'missing', which is not among the tools "
                                                                        r"\(get_weather, get_time\)"),
        ("any", tools, "must be one of"),
        ({"function": {"name": "get_time"}}, tools, "as an object"),
        ({"type": "function", "function": {}}, tools, "name must be a string"),
    ]
    for choice, with_tools, message in bad:
        with pytest.raises(ValueError, match=message):
            check_tool_choice(choice, with_tools)


def test_check_tool_messages():
    check_tool_messages(tool_loop())
    check_tool_messages([{"role": "user", "content": "x"}])
    early = tool_loop()
    early.insert(1, {"role": "tool", "tool_call_id": "call_1", "content": "x"})
    with pytest.raises(ValueError, match=r"messages\[1\]: tool_call_id 'call_1' matches no tool call"):
        check_tool_messages(early)
    unknown = tool_loop()
    unknown[4]["tool_call_id"] = "call_9"
    with pytest.raises(ValueError, match=r"messages\[4\]: tool_call_id 'call_9'"):
        check_tool_messages(unknown)
    missing = tool_loop()
    del missing[3]["tool_call_id"]
    with pytest.raises(ValueError, match=r"messages\[3\]: a tool message needs the tool_call_id"):
        check_tool_messages(missing)
    no_name = tool_loop()
    del no_name[2]["tool_calls"][0]["function"]["name"]
    with pytest.raises(ValueError, match=r"messages\[2\]\.tool_calls\[0\]\.function must be"):
        check_tool_messages(no_name)
    bad_args = tool_loop()
    bad_args[2]["tool_calls"][0]["function"]["arguments"] = "[1]"
    with pytest.raises(ValueError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments must be a JSON object"):
        check_tool_messages(bad_args)
