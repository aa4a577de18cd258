"""Bare JSON tool calls in the Hermes syntax: small models asked with `tool_choice: auto` often write a call
as a bare JSON object, `{"name": "get_weather", "arguments": {"city": "Oslo"}}`, without the template's
`<tool_call>` tags, and a parser that wants the tags loses the call and ends the agent's loop.

The rule: an answer whose text begins (after whitespace) with a JSON object that
- names one of the request's tools (`"name"`), and
- has its arguments (`"arguments"` or `"parameters"`) as a JSON object holding every property the
  tool's schema requires (no arguments at all counts as `{}`),
is that call; the text after the object is parsed as usual (more tagged calls, content). Any other answer
is parsed as before, character for character. In a stream, an answer that begins with `{` is held while
that first object is open and still well-formed, so an ordinary answer is held back only as long as the
ambiguity lasts: until its first character that is not `{` (after whitespace), its first malformed
character, or the object's closing brace."""
from __future__ import annotations

import json

from sudu.tools.parser import HERMES, ToolCall, _ObjectScanner, _parse_call_object, new_call_id


def _call(text: str, end: int, tools: dict[str, dict]) -> ToolCall | None:
    """The call in text[:end] (a complete JSON object after whitespace), if it is one under the rule."""
    start = len(text) - len(text.lstrip())
    found = _parse_call_object(text[:end], start, HERMES)
    if found is None or found.name not in tools:
        return None
    arguments = "{}" if found.args_span is None else text[found.args_span[0]:found.args_span[1]]
    required = (tools[found.name] or {}).get("required") or []
    if required and not set(required) <= set(json.loads(arguments)):
        return None
    return ToolCall(new_call_id(), found.name, arguments)


def leading_call(text: str, tools: dict[str, dict]) -> tuple[ToolCall | None, str]:
    """(the bare call the text begins with, the text after it), or (None, text): `BareCallStream` run over the
    whole text, so the whole and the streamed rule are one."""
    stream = BareCallStream(tools)
    decided = stream.feed(text)
    return decided if decided is not None else (None, stream.finish())


class BareCallStream:
    """The same rule over text in pieces: `feed` returns None while undecided, else (call or None, the text
    to parse as usual: everything held when there was no call, the text after the object when there was).
    After the decision it passes text through."""

    def __init__(self, tools: dict[str, dict]):
        self._tools = tools
        self._held = ""
        self._scanner: _ObjectScanner | None = _ObjectScanner(0)

    def feed(self, text: str) -> tuple[ToolCall | None, str] | None:
        if self._scanner is None:
            return None, text
        self._held += text
        self._scanner.scan(self._held)
        if self._scanner.malformed:
            return self._decide(None, self._held)
        if self._scanner.end is None:
            return None
        end = self._scanner.end
        call = _call(self._held, end, self._tools)
        return self._decide(call, self._held[end:] if call is not None else self._held)

    def finish(self) -> str:
        """The text still held (an object never closed is no call)."""
        held = self._held if self._scanner is not None else ""
        self._scanner, self._held = None, ""
        return held

    def _decide(self, call: ToolCall | None, rest: str) -> tuple[ToolCall | None, str]:
        self._scanner, self._held = None, ""
        return call, rest
