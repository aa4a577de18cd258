"""Reasoning models on every API: the `<think>` text goes to chat's `reasoning_content`, Messages' `thinking`
blocks and Responses' `reasoning` items, never into the answer, streamed (split anywhere) and not.

Two engines: the scripted fake, which answers a prompt with its own bytes one per step (so the answer is
exactly the text under test, split at every character), and the real engine on a tiny random model
given Qwen3's chat template (greedy; the llama one, whose greedy text is not all whitespace), checked against the same prompt's raw text from /v1/completions
rendered by transformers' own template engine (an independent reference)."""
from __future__ import annotations

import json
import random
import shutil

import anthropic
import httpx
import openai
import pytest

from sudu.config import EngineConfig
from sudu.server.app import build_app
from sudu.server.reasoning import ReasoningSplitter, opens_reasoning, reasoning_template, split_reasoning
from sudu.server.response_store import ResponseStore
from tests.helpers.fake_engine import ByteTokenizer, FakeEngine
from tests.helpers.live_server import LiveServer, sse_events

# Qwen3's chat template (as the model ships it), the fixture of the real-engine test
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
# DeepSeek-R1 style: the generation prompt opens the block, the model writes only its end
R1_TEMPLATE = QWEN3_TEMPLATE.replace("{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}",
                                     "{{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- else %}\n        {{- '<think>\\n' }}"
                                     "\n    {%- endif %}")


# ---------------------------------------------------------------- the splitter


@pytest.mark.parametrize("text, starts_open, reasoning, content", [
    ("<think>\nplan it\n</think>\n\nThe answer.", False, "plan it\n", "The answer."),
    ("  <think>a</think>b", False, "a", "b"),
    ("no thinking here", False, None, "no thinking here"),
    ("answer <think>not reasoning</think>", False, None, "answer <think>not reasoning</think>"),
    ("plan</think>\nanswer", True, "plan", "answer"),
    ("<think>cut short by the limit", False, "cut short by the limit", ""),
    ("<thin", False, None, "<thin"),
    ("all reasoning </thi", True, "all reasoning </thi", ""),
    ("<think></think>", False, "", ""),
])
def test_split_whole_and_at_every_cut(text, starts_open, reasoning, content):
    assert split_reasoning(text, starts_open) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        splitter = ReasoningSplitter(starts_open)
        parts = []
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            parts += splitter.feed(text[a:b])
        parts += splitter.finish()
        got_reasoning = "".join(t for k, t in parts if k == "reasoning")
        assert (got_reasoning if splitter.reasoning_seen else None, "".join(t for k, t in parts if k == "content")) \
            == (reasoning, content)


def test_template_detection():
    assert reasoning_template(QWEN3_TEMPLATE) and not reasoning_template("{{ messages }}")
    assert opens_reasoning("<|im_start|>assistant\n<think>\n") and not opens_reasoning("assistant\n<think>\n\n</think>\n\n")


def test_response_store_bounds():
    now = [0.0]
    store = ResponseStore(max_entries=2, max_age_s=10, clock=lambda: now[0])
    store.put("a", [{"role": "user", "content": "1"}], {"id": "a"})
    store.put("b", [], {"id": "b"})
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", [], {"id": "c"})
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    now[0] = 11.0
    assert store.get("a") is None and store.get("c") is None and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)


# ---------------------------------------------------------------- every API, on the echoing fake engine


class ThinkingEchoTokenizer(ByteTokenizer):
    """A template with thinking that renders only the last message: the fake engine then answers exactly
    the user's text, so a test writes the model's answer."""

    template_source = "{{ messages }}{# <think> ... </think> #}"

    def encode_chat(self, messages, add_generation_prompt=True, max_tokens=None, tools=None, template_kwargs=None):
        return self.encode(messages[-1]["content"], max_tokens=max_tokens)


ANSWER = "<think>\nFirst, the weather.\n</think>\n\nWear a coat."
TOOL_ANSWER = '<think>I need the tool.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def echo():
    engine = FakeEngine(step_s=0.0005)
    engine.tokenizer = ThinkingEchoTokenizer()
    with LiveServer(build_app(engine, served_model_name="m")) as server:
        yield server


def test_chat_reasoning_content(echo):
    client = openai.OpenAI(base_url=echo.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ANSWER}],
                                       max_tokens=len(ANSWER))
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "First, the weather.\n" and msg.content == "Wear a coat."
    assert r.usage.completion_tokens_details.reasoning_tokens == len(ANSWER.split("</think>")[0]) + len("</think>")
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": ANSWER}],
                                                 max_tokens=len(ANSWER), stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "First, the weather.\n"
    assert "".join(d.content or "" for d in deltas) == "Wear a coat."
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == \
        r.usage.completion_tokens_details.reasoning_tokens
    # with tools: the call after the reasoning is a call, the reasoning stays out of the answer
    tools = [{"type": "function", "function": {"name": TOOL["name"], "parameters": TOOL["input_schema"]}}]
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": TOOL_ANSWER}], tools=tools,
                                       max_tokens=len(TOOL_ANSWER))
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.model_extra["reasoning_content"] == "I need the tool."
    assert msg.content is None and json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo"}


def test_messages_thinking_blocks(echo):
    client = anthropic.Anthropic(base_url=echo.url, api_key="x", max_retries=0)
    for text, tools, blocks in [(ANSWER, None, [("thinking", "First, the weather.\n"), ("text", "Wear a coat.")]),
                                (TOOL_ANSWER, [TOOL], [("thinking", "I need the tool."), ("tool_use", "get_weather")])]:
        kwargs = dict(model="m", max_tokens=len(text), messages=[{"role": "user", "content": text}])
        if tools:
            kwargs["tools"] = tools
        whole = client.messages.create(**kwargs)
        got = [(b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else b.name)
               for b in whole.content]
        assert got == blocks
        assert whole.stop_reason == "max_tokens"  # the fake engine ends every answer at max_tokens
        assert whole.usage.output_tokens_details.thinking_tokens == len(text.split("</think>")[0]) + len("</think>")
        with client.messages.stream(**kwargs) as stream:
            thinking = "".join(e.thinking for e in stream if e.type == "thinking")
            final = stream.get_final_message()
        assert thinking == blocks[0][1]
        assert [b.model_dump(exclude={"id"}) for b in final.content] == \
            [b.model_dump(exclude={"id"}) for b in whole.content]


def test_responses_reasoning_items(echo):
    client = openai.OpenAI(base_url=echo.url + "/v1", api_key="x", max_retries=0)
    whole = client.responses.create(model="m", input=ANSWER, max_output_tokens=len(ANSWER))
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "First, the weather.\n" and whole.output_text == "Wear a coat."
    assert whole.usage.output_tokens_details.reasoning_tokens == len(ANSWER.split("</think>")[0]) + len("</think>")
    events = list(client.responses.create(model="m", input=ANSWER, max_output_tokens=len(ANSWER), stream=True))
    types = [e.type for e in events]
    assert {"response.reasoning_text.delta", "response.reasoning_text.done", "response.output_text.delta"} <= set(types)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "First, the weather.\n"
    assert events[-1].response.output_text == "Wear a coat."
    assert events[-1].response.usage == whole.usage


# ---------------------------------------------------------------- the real engine with Qwen3's template


@pytest.fixture(scope="module", params=["qwen3", "r1"])
def thinking_live(request, tiny_model_dirs, tmp_path_factory):
    from sudu.engine.async_engine import AsyncLLMEngine

    path = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dirs["llama"], path)
    (path / "chat_template.jinja").write_text(QWEN3_TEMPLATE if request.param == "qwen3" else R1_TEMPLATE)
    engine = AsyncLLMEngine(EngineConfig(model=str(path), max_model_len=1024, max_num_seqs=8,
                                         kv_cache_memory=8 << 20), max_queue_len=16)
    with LiveServer(build_app(engine, served_model_name="m")) as server:
        server.model_path, server.style = path, request.param
        yield server


def _raw_answer(server, messages: list[dict], enable_thinking: bool, max_tokens: int) -> str:
    """The greedy answer's raw text: the prompt rendered by transformers, generated as a plain completion."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(server.model_path)
    hf.chat_template = (server.model_path / "chat_template.jinja").read_text()
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                    enable_thinking=enable_thinking)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                   timeout=60)
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_thinking_template_fields_in_every_api(thinking_live, enable_thinking):
    server, n = thinking_live, 12
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    raw = _raw_answer(server, messages, enable_thinking, n)
    if server.style == "r1" and enable_thinking:  # the prompt opened the block: everything is reasoning
        expected = split_reasoning(raw, starts_open=True)
        assert expected[0] is not None
    else:  # Qwen3's own: the (random) model does not open a block, or the template closed it
        expected = split_reasoning(raw, starts_open=False)
    reasoning, content = expected

    chat = {"model": "m", "messages": messages, "max_tokens": n, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": enable_thinking}}
    msg = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["message"]
    assert (msg.get("reasoning_content"), msg["content"]) == (reasoning, content)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
        deltas = [e["choices"][0]["delta"] for e in sse_events(r) if e != "[DONE]" and e["choices"]]
    streamed_reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert (streamed_reasoning if reasoning is not None else None, "".join(d.get("content") or "" for d in deltas)) \
        == (reasoning, content)

    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    kwargs = dict(model="m", max_tokens=n, extra_body={"temperature": 0}, messages=messages,
                  thinking={"type": "enabled", "budget_tokens": n} if enable_thinking else {"type": "disabled"})
    expected_blocks = ([("thinking", reasoning)] if reasoning else []) + ([("text", content)] if content else [])
    whole = claude.messages.create(**kwargs)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content] == expected_blocks
    with claude.messages.stream(**kwargs) as stream:
        for _ in stream:
            pass
        assert [b.model_dump(exclude={"parsed_output"}) for b in stream.get_final_message().content] == \
            [b.model_dump() for b in whole.content]

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kwargs = dict(model="m", input=messages, max_output_tokens=n, temperature=0, store=False,
                  reasoning={"effort": "medium" if enable_thinking else "none"})
    whole = oai.responses.create(**kwargs)
    items = [(i.type, i.content[0].text) for i in whole.output]
    assert items == ([("reasoning", reasoning)] if reasoning else []) + ([("message", content)] if content else [])
    events = list(oai.responses.create(stream=True, **kwargs))
    assert [(i.type, i.content[0].text) for i in events[-1].response.output] == items
