"""Chat answers with tool calls in OpenAI's shape: `message.tool_calls` in a single body, and
`delta.tool_calls` in a stream (the call's id, type and name first, then its arguments in pieces, as
OpenAI streams them). The model's tool-call syntax is parsed by sudu/tools/parser.py; nothing of it
reaches `content`. A choice that called a tool ends with finish_reason "tool_calls" (unless it was cut
short by the token limit: "length"). On a template with thinking, the reasoning goes to
`reasoning_content` (answer_events.py splits it off before the tool-call parser sees the answer)."""
from __future__ import annotations

from sudu.server.answer_events import Answer, AnswerEvents, Reasoning
from sudu.tools.bare_calls import leading_call
from sudu.tools.parser import HERMES, ContentDelta, ToolCallArgsDelta, ToolCallStart, parse_tool_calls


def message(text: str, fmt: str, tools: dict[str, dict] | None = None) -> tuple[dict, bool]:
    """The assistant message for a whole answer, and whether it called tools. tools: name -> parameter
    schema where a bare JSON call counts (tool_choice auto; sudu/tools/bare_calls.py)."""
    bare = None
    if tools and fmt == HERMES:
        bare, text = leading_call(text, tools)
    content, calls = parse_tool_calls(text, fmt)
    calls = ([bare] if bare is not None else []) + calls
    msg: dict = {"role": "assistant", "content": content if content is not None or calls else ""}
    if calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return msg, bool(calls)


def answer_message(answer: Answer) -> dict:
    """The assistant message of an answer split by AnswerEvents (reasoning in `reasoning_content`)."""
    msg: dict = {"role": "assistant", "content": answer.content if answer.content is not None or answer.calls else ""}
    if answer.reasoning is not None:
        msg["reasoning_content"] = answer.reasoning
    if answer.calls:
        msg["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                             for i, n, a in answer.calls]
    return msg


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChoiceStream:
    """One streamed choice: text pieces in, `delta` objects out (adjacent content, adjacent reasoning, and
    adjacent argument pieces of one call, merged into one delta). fmt: the tool-call syntax (None: no
    tools); reasoning / reasoning_open: as PreparedCall's."""

    def __init__(self, fmt: str | None, reasoning: bool = False, reasoning_open: bool = False,
                 tools: dict[str, dict] | None = None):
        self._events = AnswerEvents(fmt, reasoning, reasoning_open, tools)

    @property
    def called(self) -> bool:
        return self._events.called

    @property
    def reasoning_tokens(self) -> int:
        return self._events.reasoning_tokens

    def render(self, text: str | None, reason: str | None, num_tokens: int = 0) -> tuple[list[dict], str | None]:
        """The deltas a piece of text settles, and the finish reason to send; with a finish reason, the held
        text is settled too. Never empty where a finish reason must go out (then one empty delta)."""
        deltas = self._deltas(self._events.feed(text, num_tokens)) if text else []
        if reason is not None:
            deltas += self._deltas(self._events.finish())
            reason = finish_reason(reason, self.called)
            deltas = deltas or [{}]
        return deltas, reason

    def _deltas(self, events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            last = out[-1] if out else None
            if isinstance(e, Reasoning):
                if last is not None and "reasoning_content" in last:
                    last["reasoning_content"] += e.text
                else:
                    out.append({"reasoning_content": e.text})
            elif isinstance(e, ContentDelta):
                if not e.text:
                    continue
                if last is not None and "content" in last:
                    last["content"] += e.text
                else:
                    out.append({"content": e.text})
            elif isinstance(e, ToolCallStart):
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
