"""Tool calls out of generated text: streaming (`ToolCallStreamParser`), and whole (`parse_tool_calls`), which
is the streaming parser run over the whole text, so the two share one grammar and cannot drift.

Two syntaxes, chosen by `fmt` (`detect_format` picks one from a chat template):

- "hermes" (Qwen 2.5, Hermes, most ChatML tool models): anywhere in the text,
  `<tool_call>` JSON-object `</tool_call>`, one or several, with text before, between or after them.
  A block is a call when its object holds a non-empty string "name" and, if present, an object
  "arguments" (or "parameters"); no arguments means `{}`. The closing tag may be missing at the very
  end of the text (generation stopped right after the object). Any other block (bad JSON, no name,
  junk after the object) stays in the content verbatim, up to and including its first `</tool_call>`.
- "llama3" (Llama 3.1/3.2 JSON tool calls): only when the text starts (after whitespace) with an
  optional `<|python_tag|>` and a JSON object holding a string "name" and an object "parameters"
  (or "arguments"); further calls may follow, separated by whitespace and/or `;`, each with its own
  optional `<|python_tag|>`. Text after the last call, from the first item that is not a call, is
  content; an output whose first item is not a call is all content. (`<|python_tag|>` is a special
  token: it appears in the text only when the detokenizer keeps special tokens; both ways parse.)

Content is the text outside calls, joined and stripped of leading and trailing whitespace (None when
empty). A call's `arguments` is the model's own text of the arguments object, untouched, so the
string a client receives is exactly what the model wrote (and always `json.loads` to a dict).

Streaming events and their guarantees, for text that parses the same way whole:
- `ContentDelta(text)`: content. Leading whitespace is dropped and a run of whitespace is held until
  non-whitespace content follows it, so the concatenated deltas equal the whole parse's content
  exactly (or "" where it is None). A tail that could begin `<tool_call>` / `<|python_tag|>` / a
  llama3 call is held until it is decided, so no call text ever appears as content.
- `ToolCallStart(index, id, name)`: once the name is complete (llama3: once the name is complete and
  the arguments key has been seen, so a plain JSON answer is not announced as a call). `index`
  counts calls from 0.
- `ToolCallArgsDelta(index, text)`: arguments text as it arrives; the concatenation for one call
  equals that call's `arguments` in the whole parse.
A block is announced only when the text at hand does not already show it malformed, so a block that
turns out malformed before its call was announced comes out as content, as in the whole parse. One that
turns out malformed after (say `{"name": "f", "arguments": [1]}`) cannot take back
its announcement: the call stays, and the block's text not yet sent as arguments becomes content;
this is the one place where stream and whole parse differ.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

HERMES = "hermes"
LLAMA3 = "llama3"
FORMATS = (HERMES, LLAMA3)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

_ARGS_KEYS = ("arguments", "parameters")
_JSON_WS = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsnNaIiy")
_SETTLED_KEEP_CHARS = 4096
_CALL, _MALFORMED = "call", "malformed"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    text: str


def new_call_id() -> str:
    """An OpenAI-like tool call id: `call_` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def detect_format(chat_template_source: str | None) -> str:
    """The tool-call syntax a model was trained on, judged from its chat template."""
    source = chat_template_source or ""
    if TOOL_CALL_OPEN in source:
        return HERMES
    if PYTHON_TAG in source or "ipython" in source:
        return LLAMA3
    return HERMES


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; known: {', '.join(FORMATS)}")


def _skip_ws(text: str, i: int, chars: str = _JSON_WS) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


@dataclass(frozen=True)
class _CallObject:
    name: str
    args_span: tuple[int, int] | None  # the arguments object's text in the whole text
    end: int  # just past the closing brace


def _parse_call_object(text: str, start: int, fmt: str) -> _CallObject | None:
    """The call in the JSON object at text[start] (a "{"), or None when it is not valid JSON or not a
    call. Walks the top level itself, decoding each key and value with json, to know where the
    arguments' text lies."""
    if not text.startswith("{", start):
        return None
    i = _skip_ws(text, start + 1)
    found: dict[str, tuple[object, int, int]] = {}
    if text.startswith("}", i):
        return None  # an empty object has no name
    while True:
        if not text.startswith('"', i):
            return None
        try:
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_ws(text, i)
            if not text.startswith(":", i):
                return None
            value_start = _skip_ws(text, i + 1)
            value, i = _DECODER.raw_decode(text, value_start)
        except ValueError:
            return None
        if key == "name" or key in _ARGS_KEYS:
            slot = "args" if key in _ARGS_KEYS else "name"
            if slot in found:
                return None  # two names or two argument objects: ambiguous
            found[slot] = (value, value_start, i)
        i = _skip_ws(text, i)
        if text.startswith(",", i):
            i = _skip_ws(text, i + 1)
            continue
        if text.startswith("}", i):
            end = i + 1
            break
        return None
    name = found.get("name", (None,))[0]
    if not isinstance(name, str) or not name:
        return None
    if "args" not in found:
        return None if fmt == LLAMA3 else _CallObject(name, None, end)
    args, args_start, args_end = found["args"]
    if not isinstance(args, dict):
        return None
    return _CallObject(name, (args_start, args_end), end)


def _finish_content(parts: list[str]) -> str | None:
    return "".join(parts).strip() or None


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a complete generated text: the streaming parser run over all of it, so the whole
    and the streamed parse share one grammar. See the module docstring for the rules."""
    parser = ToolCallStreamParser(fmt)
    content: list[str] = []
    starts: list[ToolCallStart] = []
    arguments: dict[int, list[str]] = {}
    for event in parser.feed(text, last=True):
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            starts.append(event)
        else:
            arguments.setdefault(event.index, []).append(event.text)
    calls = [ToolCall(start.id, start.name, "".join(arguments.get(start.index, []))) for start in starts]
    return _finish_content(content), calls


class _ObjectScanner:
    """Follows one JSON object character by character, as far as the text goes, noting where the
    top-level "name" and arguments values lie. It checks only structure (brackets, strings, the
    key/colon/value/comma order), enough to tell early that a block cannot be a call; the complete
    object is then judged by `_parse_call_object`."""

    def __init__(self, pos: int):
        self.pos = pos  # the next character to read; a character found bad is not consumed
        self.stack: list[str] = []
        self.state = "lead"
        self.in_string = self.escape = self.scalar = False
        self.key_start = self.value_start = 0
        self.key: str | None = None
        self.seen: set[str] = set()
        self.obj_start: int | None = None
        self.name_span: tuple[int, int] | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.end: int | None = None
        self.malformed = False

    def scan(self, text: str) -> None:
        while self.pos < len(text) and not self.malformed and self.end is None:
            if self._step(text, text[self.pos], self.pos):
                self.pos += 1
            else:
                self.malformed = True

    def _step(self, text: str, c: str, i: int) -> bool:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if len(self.stack) == 1:
                    return self._key_done(text, i + 1) if self.state == "key" else self._value_done(i + 1)
            elif c < " ":
                return False  # JSON strings hold no raw control characters
            return True
        if self.state == "lead":
            if c in _JSON_WS:
                return True
            if c != "{":
                return False
            self.stack.append("{")
            self.obj_start, self.state = i, "key_or_close"
            return True
        if self.scalar:
            if c not in _JSON_WS and c not in ",}":
                return c in _SCALAR_CHARS
            self.scalar = False
            self._value_done(i)
        if len(self.stack) > 1:
            return self._nested(c, i)
        if c in _JSON_WS:
            return True
        if self.state in ("key_or_close", "key"):
            if c == "}" and self.state == "key_or_close":
                return self._close(i)
            if c != '"':
                return False
            self.in_string, self.key_start, self.state = True, i, "key"
            return True
        if self.state == "colon":
            self.state = "value"
            return c == ":"
        if self.state == "value":
            return self._value_start(c, i)
        if self.state == "comma":
            if c == ",":
                self.state = "key"
                return True
            return c == "}" and self._close(i)
        return False

    def _nested(self, c: str, i: int) -> bool:
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.stack.append(c)
        elif c in "}]":
            if self.stack[-1] != ("{" if c == "}" else "["):
                return False
            self.stack.pop()
            if len(self.stack) == 1:
                return self._value_done(i + 1)
        return True

    def _key_done(self, text: str, end: int) -> bool:
        try:
            self.key = json.loads(text[self.key_start:end])
        except ValueError:
            return False
        self.state = "colon"
        return True

    def _value_start(self, c: str, i: int) -> bool:
        slot = "args" if self.key in _ARGS_KEYS else self.key
        if slot in ("name", "args"):
            if slot in self.seen or c != ('"' if slot == "name" else "{"):
                return False
            self.seen.add(slot)
            if slot == "args":
                self.args_start = i
        self.value_start, self.state = i, "in_value"
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.stack.append(c)
        elif c in _SCALAR_CHARS:
            self.scalar = True
        else:
            return False
        return True

    def _value_done(self, end: int) -> bool:
        if self.key == "name":
            self.name_span = (self.value_start, end)
        elif self.key in _ARGS_KEYS:
            self.args_end = end
        self.state = "comma"
        return True

    def _close(self, i: int) -> bool:
        self.stack.pop()
        self.end = i + 1
        return True


class _Block:
    """One call being streamed: a `<tool_call>` block or one llama3 item."""

    def __init__(self, start: int, body: int):
        self.start = start  # where its text begins (the tag, or the object)
        self.body = body  # where the object (after optional whitespace) is looked for
        self.scanner = _ObjectScanner(body)
        self.name: str | None = None
        self.id = new_call_id()
        self.started = False
        self.sent_upto = start  # the call's text up to here is represented by events already
        self.args_sent: int | None = None


class ToolCallStreamParser:
    """Turns generated text, fed in pieces split anywhere, into content and tool call events (see the
    module docstring). `feed` returns the events the new text settles; `finish` the rest."""

    def __init__(self, fmt: str):
        _check_format(fmt)
        self._fmt = fmt
        self._text = ""
        self._pos = 0  # text before this is settled
        self._state = "content" if fmt == HERMES else "lead"
        self._block: _Block | None = None
        self._malformed_from = 0  # in state "malformed": the block's text from here is content
        self._index = 0
        self._content_started = False
        self._held_ws = ""
        self._final = False
        self._events: list = []

    def feed(self, text_delta: str, last: bool = False) -> list:
        """The events text_delta settles; `last` says the text ends with it (feed, then finish, in one)."""
        if self._final:
            raise ValueError("feed after finish")
        self._text += text_delta
        self._final = last
        return self._run()

    def finish(self) -> list:
        """Settles everything left: an unfinished block is malformed, a held tail is content."""
        if self._final:
            return []
        self._final = True
        return self._run()

    def _run(self) -> list:
        self._events = []
        steps = {"content": self._step_content, "block": self._step_block, "malformed": self._step_malformed, "lead": self._step_lead, "sep": self._step_sep,
                 "plain": self._step_plain}
        while steps[self._state]():
            pass
        if self._block is None and self._pos > _SETTLED_KEEP_CHARS:
            # settled text is never read again; dropping it keeps a long answer's feeds cheap
            self._text, self._pos = self._text[self._pos:], 0
        events, merged = self._events, []
        for event in events:
            if merged and isinstance(event, ContentDelta) and isinstance(merged[-1], ContentDelta):
                merged[-1] = ContentDelta(merged[-1].text + event.text)
            else:
                merged.append(event)
        return merged

    def _content(self, text: str) -> None:
        if not self._content_started:
            text = text.lstrip()
        if not text:
            return
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            self._content_started = True
            self._events.append(ContentDelta(body))

    # hermes

    def _step_content(self) -> bool:
        text = self._text
        open_at = text.find(TOOL_CALL_OPEN, self._pos)
        if open_at >= 0:
            self._content(text[self._pos:open_at])
            self._open_block(open_at, open_at + len(TOOL_CALL_OPEN))
            return True
        end = len(text) if self._final else len(text) - _held_prefix(text, self._pos, TOOL_CALL_OPEN)
        self._content(text[self._pos:end])
        self._pos = end
        return False

    def _open_block(self, start: int, body: int) -> None:
        self._block = _Block(start, body)
        self._pos = start
        self._state = "block"

    def _step_block(self) -> bool:
        block, text = self._block, self._text
        scanner = block.scanner
        scanner.scan(text)
        if block.name is None and scanner.name_span is not None and not scanner.malformed:
            try:
                block.name = json.loads(text[scanner.name_span[0]:scanner.name_span[1]]) or None
            except ValueError:
                pass
            scanner.malformed = block.name is None
        fate, end = self._fate(block)
        # announced once the name is complete, unless the text at hand already shows the block malformed:
        # run over a whole text, every fate is known here and the parse is the whole-text one
        if (fate != _MALFORMED and not block.started and block.name is not None
                and (self._fmt == HERMES or scanner.args_start is not None)):
            block.started = True
            block.sent_upto = max(scanner.name_span[1], (scanner.args_start or 0) + 1)
            self._events.append(ToolCallStart(self._index, block.id, block.name))
        if block.started and scanner.args_start is not None:
            upto = scanner.pos if scanner.args_end is None else min(scanner.pos, scanner.args_end)
            sent = block.args_sent if block.args_sent is not None else scanner.args_start
            if upto > sent:
                self._events.append(ToolCallArgsDelta(self._index, text[sent:upto]))
                block.args_sent = upto
                block.sent_upto = max(block.sent_upto, upto)
        if fate == _MALFORMED:
            return self._malformed()
        if fate is None:
            return False
        self._end_call(end)
        self._state = "content" if self._fmt == HERMES else "sep"
        return True

    def _fate(self, block: _Block) -> tuple[str | None, int]:
        """(_CALL, where the call's text ends), (_MALFORMED, 0), or (None, 0) while the text so far cannot tell.
        A complete object is judged by `_parse_call_object`; a Hermes call must then be followed by
        `</tool_call>` or by the end of the whole text."""
        scanner, text = block.scanner, self._text
        if scanner.malformed or (self._final and scanner.end is None):
            return _MALFORMED, 0
        if scanner.end is None:
            return None, 0
        call = _parse_call_object(text, scanner.obj_start, self._fmt)
        if call is None or call.end != scanner.end or call.name != block.name:
            return _MALFORMED, 0
        if self._fmt == LLAMA3:
            return _CALL, scanner.end
        after = _skip_ws(text, scanner.end)
        rest = text[after:after + len(TOOL_CALL_CLOSE)]
        if rest == TOOL_CALL_CLOSE or (self._final and not rest):
            return _CALL, after + len(rest)
        if TOOL_CALL_CLOSE.startswith(rest) and not self._final:
            return None, 0
        return _MALFORMED, 0

    def _end_call(self, end: int) -> None:
        block = self._block
        if block.scanner.args_start is None:
            self._events.append(ToolCallArgsDelta(self._index, "{}"))
        self._index += 1
        self._block = None
        self._pos = end

    def _malformed(self) -> bool:
        block = self._block
        self._malformed_from = block.sent_upto if block.started else block.start
        if block.started:
            self._index += 1
        if self._fmt == LLAMA3:
            self._pos = self._malformed_from
            self._state = "plain"
        else:
            self._state = "malformed"
        return True

    def _step_malformed(self) -> bool:
        text, block = self._text, self._block
        close = text.find(TOOL_CALL_CLOSE, block.body)
        if close < 0:
            self._content(text[self._malformed_from:])
            self._malformed_from = len(text)
            self._pos = len(text)
            return False
        end = close + len(TOOL_CALL_CLOSE)
        self._content(text[self._malformed_from:end])
        self._pos = max(end, self._malformed_from)
        self._block = None
        self._state = "content"
        return True

    # llama3

    def _step_lead(self) -> bool:
        return self._step_item(_skip_ws(self._text, self._pos), first=True)

    def _step_sep(self) -> bool:
        return self._step_item(_skip_ws(self._text, self._pos, _JSON_WS + ";"), first=False)

    def _step_item(self, at: int, first: bool) -> bool:
        text = self._text
        rest = text[at:at + len(PYTHON_TAG)]
        if text.startswith(PYTHON_TAG, at):
            self._open_block(at, at + len(PYTHON_TAG))
            return True
        if rest.startswith("{"):
            self._open_block(at, at)
            return True
        if (not rest or PYTHON_TAG.startswith(rest)) and not self._final:
            return False
        self._pos = self._pos if first else at
        self._state = "plain"
        return True

    def _step_plain(self) -> bool:
        self._content(self._text[self._pos:])
        self._pos = len(self._text)
        return False


def _held_prefix(text: str, start: int, marker: str) -> int:
    """How many characters at the end of text[start:] could be the beginning of marker."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
