"""The four streaming APIs sudu bench speaks besides building chat bodies: OpenAI chat completions, OpenAI
(text) completions, Anthropic Messages and OpenAI Responses. Every suite builds a chat-style body; this
module translates it into the chosen API's body and endpoint, and turns each API's stream events into one
normalized shape (`Parsed`): generated text split into answer / reasoning / tool-call pieces, the finish
reason, the usage in OpenAI's field names, an error, or the end of the stream.

Usage normalization (what `metrics.cached_tokens` and the cost accounting read):
- chat, completions: as sent (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`);
- messages: Anthropic's `input_tokens` excludes cache reads and writes, so prompt_tokens = input_tokens +
  cache_read_input_tokens + cache_creation_input_tokens, cached_tokens = cache_read_input_tokens;
- responses: `input_tokens` (cached ones included), `input_tokens_details.cached_tokens`, `output_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

APIS = ("chat", "completions", "messages", "responses")
ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions", "messages": "/messages",
             "responses": "/responses"}


@dataclass
class Parsed:
    """What one stream event carried, in API-independent terms."""

    pieces: list[tuple[str, str]] = field(default_factory=list)  # (answer | reasoning | tool, text)
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    done: bool = False  # the API's own end-of-stream marker
    tool_deltas: list | None = None  # chat's delta.tool_calls, merged by the client


def message_text(content) -> str:
    """A message's text: the string, or its text parts' (image parts carry none)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def render_prompt(messages: list[dict]) -> str:
    """A chat conversation as one plain prompt for /v1/completions: each message's text on its own
    paragraph, in order (no chat template: the completions API takes text as it is)."""
    return "\n\n".join(message_text(m.get("content")) for m in messages if message_text(m.get("content")))


def translate(body: dict, api: str) -> dict:
    """The chat body `body` (model, messages, max_tokens, temperature, stream_options, extras) as `api`'s
    body. A body carrying `prompt` (replay's raw text) is sent as that text to completions, and as one
    user message to the others."""
    if api not in APIS:
        raise ValueError(f"unknown api {api!r}")
    body = dict(body)
    prompt = body.pop("prompt", None)
    messages = body.pop("messages", None) or [{"role": "user", "content": prompt or ""}]
    if api == "chat":
        return {**body, "messages": messages}
    if api == "completions":
        return {**body, "prompt": prompt if prompt is not None else render_prompt(messages)}
    base = {k: v for k, v in body.items() if k not in ("max_tokens", "stream_options", "tools", "tool_choice",
                                                       "response_format")}
    system = "\n\n".join(message_text(m.get("content")) for m in messages if m.get("role") == "system")
    rest = [{"role": m["role"] if m.get("role") in ("user", "assistant") else "user", "content": message_text(m.get("content"))}
            for m in messages if m.get("role") != "system"]
    if api == "messages":
        out = {**base, "messages": rest, "max_tokens": body.get("max_tokens") or 1024}
        if system:
            out["system"] = system
        return out
    out = {**base, "input": rest, "max_output_tokens": body.get("max_tokens")}
    if system:
        out["instructions"] = system
    return out


def _usage_messages(u: dict) -> dict:
    read = int(u.get("cache_read_input_tokens") or 0)
    created = int(u.get("cache_creation_input_tokens") or 0)
    prompt = int(u.get("input_tokens") or 0) + read + created
    out = int(u.get("output_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": read}, "cache_creation_input_tokens": created}


def _usage_responses(u: dict) -> dict:
    prompt = int(u.get("input_tokens") or 0)
    out = int(u.get("output_tokens") or 0)
    cached = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    reasoning = (u.get("output_tokens_details") or {}).get("reasoning_tokens")
    res = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning is not None:
        res["completion_tokens_details"] = {"reasoning_tokens": int(reasoning)}
    return res


def _error_text(err) -> str:
    return err.get("message", str(err)) if isinstance(err, dict) else str(err)


def _openai_chunk(chunk: dict) -> Parsed:
    """An OpenAI-style stream chunk's error or usage (both chat and text completions carry them this way)."""
    p = Parsed()
    if "error" in chunk and not chunk.get("choices"):
        p.error = "stream error: " + _error_text(chunk["error"])
    elif chunk.get("usage"):
        p.usage = chunk["usage"]
    return p


def parse_chat(chunk: dict) -> Parsed:
    p = _openai_chunk(chunk)
    if p.error:
        return p
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        if isinstance(reasoning, str) and reasoning:
            p.pieces.append(("reasoning", reasoning))
        if delta.get("content"):
            p.pieces.append(("answer", delta["content"]))
        if delta.get("tool_calls"):
            p.tool_deltas = delta["tool_calls"]
        if choice.get("finish_reason"):
            p.finish_reason = choice["finish_reason"]
    return p


def parse_completions(chunk: dict) -> Parsed:
    p = _openai_chunk(chunk)
    if p.error:
        return p
    for choice in chunk.get("choices") or ():
        if choice.get("text"):
            p.pieces.append(("answer", choice["text"]))
        if choice.get("finish_reason"):
            p.finish_reason = choice["finish_reason"]
    return p


def parse_messages(event: str | None, data: dict, state: dict) -> Parsed:
    """Anthropic Messages: message_start (usage so far), content_block_start / _delta (text_delta,
    thinking_delta, input_json_delta) / _stop, message_delta (stop_reason, output usage), message_stop."""
    p = Parsed()
    kind = data.get("type") or event
    if kind == "error":
        p.error = "stream error: " + _error_text(data.get("error"))
    elif kind == "message_start":
        state["usage"] = dict((data.get("message") or {}).get("usage") or {})
    elif kind == "content_block_start":
        block = data.get("content_block") or {}
        state.setdefault("blocks", {})[data.get("index", 0)] = block.get("type")
        if block.get("type") == "tool_use" and block.get("name"):
            p.pieces.append(("tool", block["name"]))
            state.setdefault("tools", {})[data.get("index", 0)] = {
                "id": block.get("id"), "type": "function", "function": {"name": block["name"], "arguments": ""}}
    elif kind == "content_block_delta":
        d = data.get("delta") or {}
        if d.get("type") == "text_delta" and d.get("text"):
            p.pieces.append(("answer", d["text"]))
        elif d.get("type") == "thinking_delta" and d.get("thinking"):
            p.pieces.append(("reasoning", d["thinking"]))
        elif d.get("type") == "input_json_delta" and d.get("partial_json"):
            p.pieces.append(("tool", d["partial_json"]))
            call = state.get("tools", {}).get(data.get("index", 0))
            if call is not None:
                call["function"]["arguments"] += d["partial_json"]
    elif kind == "message_delta":
        d = data.get("delta") or {}
        if d.get("stop_reason"):
            p.finish_reason = d["stop_reason"]
        state.setdefault("usage", {}).update(data.get("usage") or {})
        p.usage = _usage_messages(state["usage"])
    elif kind == "message_stop":
        p.done = True
        if state.get("usage"):
            p.usage = _usage_messages(state["usage"])
    return p


def parse_responses(event: str | None, data: dict, state: dict) -> Parsed:
    """OpenAI Responses: response.output_text.delta (answer), response.reasoning_text.delta and
    response.reasoning_summary_text.delta (reasoning), response.function_call_arguments.delta (tool),
    response.completed / .incomplete (usage, the end), response.failed and error."""
    p = Parsed()
    kind = data.get("type") or event or ""
    if kind == "error":
        p.error = "stream error: " + _error_text(data.get("error") or data)
    elif kind == "response.output_text.delta":
        if data.get("delta"):
            p.pieces.append(("answer", data["delta"]))
    elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
        if data.get("delta"):
            p.pieces.append(("reasoning", data["delta"]))
    elif kind == "response.output_item.added":
        item = data.get("item") or {}
        if item.get("type") == "function_call":
            state.setdefault("tools", {})[data.get("output_index", 0)] = {
                "id": item.get("call_id") or item.get("id"), "type": "function",
                "function": {"name": item.get("name") or "", "arguments": ""}}
            if item.get("name"):
                p.pieces.append(("tool", item["name"]))
    elif kind == "response.function_call_arguments.delta":
        if data.get("delta"):
            p.pieces.append(("tool", data["delta"]))
            call = state.get("tools", {}).get(data.get("output_index", 0))
            if call is not None:
                call["function"]["arguments"] += data["delta"]
    elif kind in ("response.completed", "response.incomplete", "response.failed"):
        resp = data.get("response") or {}
        if resp.get("usage"):
            p.usage = _usage_responses(resp["usage"])
        if kind == "response.failed":
            p.error = "response failed: " + _error_text(resp.get("error") or "no error given")
        else:
            details = resp.get("incomplete_details") or {}
            p.finish_reason = "stop" if kind == "response.completed" else (details.get("reason") or "incomplete")
        p.done = True
    return p


def parse_event(api: str, event: str | None, data: dict, state: dict) -> Parsed:
    if api == "chat":
        return parse_chat(data)
    if api == "completions":
        return parse_completions(data)
    if api == "messages":
        return parse_messages(event, data, state)
    return parse_responses(event, data, state)


def tool_calls(state: dict) -> list[dict] | None:
    """The tool calls a messages or responses stream assembled, in order."""
    tools = state.get("tools") or {}
    return [tools[i] for i in sorted(tools)] or None
