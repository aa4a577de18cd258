"""Chat answers with tool calls in OpenAI's shape: `message.tool_calls` in a single body, and
`delta.tool_calls` in a stream (the call's id, type and name first, then its arguments in pieces, as
OpenAI streams them). The model's tool-call syntax is parsed by sudu/tools/parser.py; nothing of it
reaches `content`. A choice that called a tool ends with finish_reason "tool_calls" (unless it was cut
short by the token limit: "length")."""
from __future__ import annotations

from sudu.tools.parser import ContentDelta, ToolCallArgsDelta, ToolCallStart, ToolCallStreamParser, parse_tool_calls


def message(text: str, fmt: str) -> tuple[dict, bool]:
    """The assistant message for a whole answer, and whether it called tools."""
    content, calls = parse_tool_calls(text, fmt)
    msg: dict = {"role": "assistant", "content": content if content is not None or calls else ""}
    if calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return msg, bool(calls)


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChoiceStream:
    """One streamed choice: text pieces in, `delta` objects out (adjacent content, and adjacent argument
    pieces of one call, merged into one delta)."""

    def __init__(self, fmt: str):
        self._parser = ToolCallStreamParser(fmt)
        self.called = False

    def render(self, text: str | None, reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas a piece of text settles, and the finish reason to send; with a finish reason, the held
        text is settled too. Never empty where a finish reason must go out (then one empty delta)."""
        deltas = self._deltas(self._parser.feed(text)) if text else []
        if reason is not None:
            deltas += self._deltas(self._parser.finish())
            reason = finish_reason(reason, self.called)
            deltas = deltas or [{}]
        return deltas, reason

    def _deltas(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            last = out[-1] if out else None
            if isinstance(e, ContentDelta):
                if not e.text:
                    continue
                if last is not None and "content" in last:
                    last["content"] += e.text
                else:
                    out.append({"content": e.text})
            elif isinstance(e, ToolCallStart):
                self.called = True
                out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ToolCallArgsDelta):
                if not e.text:
                    continue
                call = last["tool_calls"][0] if last is not None and "tool_calls" in last else None
                if call is not None and call["index"] == e.index:
                    call["function"]["arguments"] += e.text
                else:
                    out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out
