"""Reasoning text out of a thinking model's answer: the one splitter every API uses (chat completions'
`reasoning_content`, Messages' `thinking` blocks, Responses' `reasoning` items).

Templates with thinking write the reasoning between `<think>` and `</think>`, in one of two ways:
- Qwen3: the model opens the block itself (`<think>...</think>answer`); with `enable_thinking: false`
  the template writes an empty, closed block into the prompt and the model answers directly;
- DeepSeek-R1: the template's generation prompt already ends with `<think>`, so the answer starts
  inside the block and only `</think>` appears in the output.
`reasoning_template` says whether a template has thinking at all; `opens_reasoning` whether a rendered
prompt ends inside an open block (R1 style). The rule for the answer: it starts in reasoning when the
prompt left a block open; otherwise a `<think>` at its very start (after whitespace) opens one. The
reasoning ends at the first `</think>`; everything after it is the answer (tool calls included). A
block never closed (the token limit cut it) is all reasoning. A `<think>` anywhere else is answer text.

`ReasoningSplitter` takes the text in pieces split anywhere and gives ("reasoning" | "content", text)
pieces; a tail that could still be a tag is held until it is decided, so the concatenated pieces of
each kind equal the whole text's split exactly. Whitespace right after `<think>` and right after
`</think>` (the newlines templates put there) is dropped."""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING, CONTENT = "reasoning", "content"
_WS = " \t\r\n"


def reasoning_template(template_source: str | None) -> bool:
    """Whether a chat template writes or expects `<think>` blocks."""
    return bool(template_source) and THINK_CLOSE in template_source


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its last characters suffice) ends inside an open `<think>` block."""
    tail = prompt_tail.rstrip(_WS)
    return tail.endswith(THINK_OPEN)


class ReasoningSplitter:
    def __init__(self, starts_open: bool):
        # lead: the answer's first characters, which may open a block; reasoning; content
        self._state = REASONING if starts_open else "lead"
        self._strip_ws = starts_open  # drop whitespace at the start of the current part
        self._held = ""
        self.closed = False  # a block was open and has ended
        self.reasoning_seen = starts_open

    @property
    def in_reasoning(self) -> bool:
        return self._state == REASONING

    @property
    def undecided(self) -> bool:
        """Still reading the answer's first characters: they may yet open a block."""
        return self._state == "lead"

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "lead":
                stripped = text.lstrip(_WS)
                if stripped.startswith(THINK_OPEN):
                    self._state, self.reasoning_seen, self._strip_ws = REASONING, True, True
                    text = stripped[len(THINK_OPEN):]
                    continue
                if THINK_OPEN.startswith(stripped):  # undecided: could still become the tag
                    self._held = text
                    return out
                self._state = CONTENT
                continue
            if self._state == REASONING:
                if self._strip_ws:
                    text = text.lstrip(_WS)
                    if not text:
                        return out
                    self._strip_ws = False
                end = text.find(THINK_CLOSE)
                if end >= 0:
                    self._emit(out, REASONING, text[:end])
                    text = text[end + len(THINK_CLOSE):]
                    self._state, self.closed, self._strip_ws = CONTENT, True, True
                    continue
                keep = _held_prefix(text, THINK_CLOSE)
                self._emit(out, REASONING, text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                return out
            if self._strip_ws:
                text = text.lstrip(_WS)
                if not text:
                    return out
                self._strip_ws = False
            self._emit(out, CONTENT, text)
            return out
        return out

    def finish(self) -> list[tuple[str, str]]:
        """The held tail: what it is now that no more text comes."""
        held, self._held = self._held, ""
        if not held:
            return []
        kind = REASONING if self._state == REASONING else CONTENT
        if kind == CONTENT and self._strip_ws:
            held = held.lstrip(_WS)
        return [(kind, held)] if held else []

    @staticmethod
    def _emit(out: list, kind: str, text: str) -> None:
        if text:
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
            else:
                out.append((kind, text))


def split_reasoning(text: str, starts_open: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer: the same split as the streaming one."""
    splitter = ReasoningSplitter(starts_open)
    parts = splitter.feed(text) + splitter.finish()
    reasoning = "".join(t for k, t in parts if k == REASONING)
    content = "".join(t for k, t in parts if k == CONTENT)
    return (reasoning if splitter.reasoning_seen else None), content


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of text could be the beginning of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
