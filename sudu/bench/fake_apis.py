"""The fake server's other APIs: a scripted chat-completions stream (fake_server.ScriptedResponse) rewritten,
event for event and at the same offsets, into OpenAI completions chunks, Anthropic Messages events
(message_start, content_block_start / _delta / _stop with text_delta and thinking_delta, message_delta,
message_stop) or OpenAI Responses events (response.created, response.output_item.added,
response.reasoning_text.delta, response.output_text.delta, response.completed). Chat `reasoning_content`
deltas become thinking blocks and reasoning items."""
from __future__ import annotations

import json

API_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
             "/v1/responses": "responses"}


def api_of(path: str) -> str:
    return API_PATHS.get(path.split("?", 1)[0], "chat")


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _chat_parts(events) -> tuple[list, dict | None, str | None]:
    """[(at_s, kind, text)] of generated text, the usage, the finish reason."""
    parts, usage, finish = [], None, None
    for ev in events:
        if not isinstance(ev.data, dict):
            continue
        if ev.data.get("usage"):
            usage = ev.data["usage"]
        for choice in ev.data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                parts.append((ev.at_s, "reasoning", delta["reasoning_content"]))
            if delta.get("content"):
                parts.append((ev.at_s, "answer", delta["content"]))
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    return parts, usage, finish


def convert_events(script, api: str, body: dict) -> list[tuple[float, dict | str | bytes]] | None:
    """The script's events as (offset, data) in `api`'s format; None: send the script as it is."""
    if api == "chat" or script.status != 200 or script.body is not None:
        return None
    parts, usage, finish = _chat_parts(script.events)
    end = max((ev.at_s for ev in script.events), default=0.0)
    start = script.events[0].at_s if script.events else 0.0
    usage = usage or {}
    prompt, out = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or usage.get("prompt_cache_hit_tokens") or 0
    events = []
    if api == "completions":
        for at, _, text in [p for p in parts if p[1] == "answer"]:  # no reasoning channel in completions
            events.append((at, {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}))
        events.append((end, {"object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": finish or "stop"}]}))
        if usage:
            events.append((end, {"object": "text_completion", "choices": [], "usage": usage}))
        events.append((end, "[DONE]"))
    elif api == "messages":
        events.append((start, _sse("message_start", {"type": "message_start", "message": {
            "id": "msg_fake", "type": "message", "role": "assistant", "model": body.get("model", "fake"), "content": [],
            "usage": {"input_tokens": prompt - cached, "cache_read_input_tokens": cached,
                      "cache_creation_input_tokens": 0, "output_tokens": 0}}})))
        index, open_kind = -1, None
        for at, kind, text in parts:
            if kind != open_kind:
                if open_kind is not None:
                    events.append((at, _sse("content_block_stop", {"type": "content_block_stop", "index": index})))
                index, open_kind = index + 1, kind
                block = {"type": "thinking", "thinking": ""} if kind == "reasoning" else {"type": "text", "text": ""}
                events.append((at, _sse("content_block_start", {"type": "content_block_start", "index": index,
                                                                       "content_block": block})))
            delta = {"type": "thinking_delta", "thinking": text} if kind == "reasoning" else {"type": "text_delta", "text": text}
            events.append((at, _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})))
        if open_kind is not None:
            events.append((end, _sse("content_block_stop", {"type": "content_block_stop", "index": index})))
        stop = {"stop": "end_turn", "length": "max_tokens"}.get(finish or "stop", finish)
        events.append((end, _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop},
                                                        "usage": {"output_tokens": out}})))
        events.append((end, _sse("message_stop", {"type": "message_stop"})))
    else:
        events.append((start, _sse("response.created", {"type": "response.created",
                                                              "response": {"id": "resp_fake", "status": "in_progress"}})))
        index, open_kind = -1, None
        for at, kind, text in parts:
            if kind != open_kind:
                index, open_kind = index + 1, kind
                item = {"type": "reasoning", "id": f"rs_{index}"} if kind == "reasoning" else \
                    {"type": "message", "id": f"msg_{index}", "role": "assistant"}
                events.append((at, _sse("response.output_item.added", {"type": "response.output_item.added",
                                                                             "output_index": index, "item": item})))
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            events.append((at, _sse(name, {"type": name, "output_index": index, "delta": text})))
        status = "completed" if finish != "length" else "incomplete"
        resp = {"id": "resp_fake", "status": status,
                "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": out}}
        if status == "incomplete":
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        events.append((end, _sse(f"response.{status}", {"type": f"response.{status}", "response": resp})))
    return events
