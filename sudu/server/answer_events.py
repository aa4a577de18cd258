"""One generated choice as a sequence of typed events, the common ground of every API's rendering: the
reasoning splitter (reasoning.py) first, then, on the answer part only, the tool-call parser
(sudu/tools/parser.py). Chat completions render the events as `delta`s, Messages as content blocks,
Responses as output items; a whole (non-streamed) answer is the same events gathered, so a stream and a
single body always agree.

With `tools` (name -> parameter schema) on the Hermes syntax, a bare JSON call at the start of the answer
is a call too (sudu/tools/bare_calls.py has the rule); the parser's calls after it are numbered on.

Events: `Reasoning(text)`, and the parser's `ContentDelta(text)`, `ToolCallStart(index, id, name)`,
`ToolCallArgsDelta(index, text)`. `reasoning_tokens` counts the generated tokens of the pieces that
arrived while the reasoning block was open (the opening and closing tags' pieces included)."""
from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import AsyncIterator

from sudu.server.errors import EngineRequestError
from sudu.server.generation import generate_all
from sudu.server.reasoning import REASONING, ReasoningSplitter
from sudu.tools.bare_calls import BareCallStream
from sudu.tools.parser import (
    HERMES,
    ContentDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    ToolCallStreamParser,
)


@dataclass(frozen=True)
class Reasoning:
    text: str


class AnswerEvents:
    def __init__(self, tool_format: str | None, reasoning: bool, reasoning_open: bool,
                 tools: dict[str, dict] | None = None):
        self._splitter = ReasoningSplitter(reasoning_open) if reasoning else None
        self._tools = ToolCallStreamParser(tool_format) if tool_format is not None else None
        self._bare = BareCallStream(tools) if tools and tool_format == HERMES else None
        self._index_offset = 0  # calls found before the parser's (a bare call)
        self.reasoning_tokens = 0
        self._undecided_tokens = 0  # tokens of the answer's first pieces, before it is known whether they open a block
        self.called = False

    def feed(self, text: str, num_tokens: int = 0) -> list:
        if self._splitter is None:
            return self._content(text)
        splitter = self._splitter
        was_open, was_undecided = splitter.in_reasoning, splitter.undecided
        parts = splitter.feed(text)
        if was_open:  # the piece arrived inside the block (the one that closes it included)
            self.reasoning_tokens += num_tokens
        elif was_undecided:
            self._undecided_tokens += num_tokens
            if splitter.reasoning_seen:
                self.reasoning_tokens += self._undecided_tokens
            if not splitter.undecided:
                self._undecided_tokens = 0
        return self._parts(parts)

    @property
    def reasoning_seen(self) -> bool:
        return self._splitter is not None and self._splitter.reasoning_seen

    def finish(self) -> list:
        events = self._parts(self._splitter.finish()) if self._splitter is not None else []
        if self._bare is not None:
            held, self._bare = self._bare.finish(), None
            events += self._content(held)
        if self._tools is not None:
            events += self._tool_events(self._tools.finish())
        return events

    def _parts(self, parts) -> list:
        events: list = []
        for kind, text in parts:
            events += [Reasoning(text)] if kind == REASONING else self._content(text)
        return events

    def _content(self, text: str) -> list:
        if self._tools is None:
            return [ContentDelta(text)] if text else []
        if self._bare is not None:
            decided = self._bare.feed(text)
            if decided is None:
                return []
            self._bare = None
            call, text = decided
            if call is not None:
                self.called, self._index_offset = True, 1
                return [ToolCallStart(0, call.id, call.name), ToolCallArgsDelta(0, call.arguments)] + \
                    self._content(text)
        return self._tool_events(self._tools.feed(text)) if text else []

    def _tool_events(self, events) -> list:
        if any(isinstance(e, ToolCallStart) for e in events):
            self.called = True
        if self._index_offset:
            events = [replace(e, index=e.index + self._index_offset) if hasattr(e, "index") else e for e in events]
        return [e for e in events if not (isinstance(e, (ContentDelta, ToolCallArgsDelta)) and not e.text)]


@dataclass
class Answer:
    """A whole answer gathered from its events: reasoning (None: the model wrote none), content (None:
    no text outside calls) and calls as [id, name, arguments]."""

    reasoning: str | None
    content: str | None
    calls: list[list[str]]


def gather(events: list, reasoning_seen: bool) -> Answer:
    reasoning, content, calls = [], [], {}
    for e in events:
        if isinstance(e, Reasoning):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls[e.index] = [e.id, e.name, ""]
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index][2] += e.text
    text = "".join(content)
    return Answer("".join(reasoning) if reasoning_seen or reasoning else None, text or None,
                  [calls[i] for i in sorted(calls)])


async def answer_steps(call, answer: AnswerEvents) -> AsyncIterator[tuple[list, object]]:
    """A call's engine outputs as typed answer events: (events, choice output) per choice output, the answer's
    closing events after its last token; the call's accounting observed on the way, an engine error raised. The
    Messages and Responses APIs render these events each in their own shape."""
    async with aclosing(generate_all(call.engine, call.jobs)) as outputs:
        async for job_index, out in outputs:
            call.observe(job_index, out)
            for c in out.outputs:
                events = answer.feed(c.text, len(c.token_ids)) if c.text else []
                if c.finish_reason is not None:
                    events = events + answer.finish()
                yield events, c
            if out.error is not None:
                raise EngineRequestError(out.error)

