"""The grammar engine (llguidance) bound to one served model: its tokenizer, compiled grammars, and a
matcher per constrained sequence.

Why llguidance (against xgrammar and outlines-core, docs/structured_output.md): an abi3 wheel with no
dependencies, so it installs anywhere sudu does; its masks are computed lazily over a token trie
(microseconds per token for JSON, with no per-schema precompilation of the whole vocabulary, so a new
schema costs milliseconds, not seconds); it takes JSON schema, regex, Lark (GBNF converts), and has
the speculative-decoding primitives sudu needs (validate_tokens, rollback, forced tokens).

A compiled grammar is kept (an LRU of `CACHE_SIZE`) as a matcher in its start state; a sequence gets a
deep copy, which is much cheaper than compiling again (agents send the same schema every turn)."""
from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import numpy as np

from sudu.structured.grammars import GrammarError

CACHE_SIZE = 64


class GrammarBackend:
    """llguidance for one tokenizer. `vocab_size` is the logits' width (the model's embedding rows, which
    may exceed the tokenizer's ids); `eos_token_ids` are the ids that end generation, allowed wherever the
    grammar is complete."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()  # prepare threads compile concurrently; the cache is shared
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about a second for a 150K vocabulary), from the tokenizer's own JSON."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def warm(self) -> None:
        """Build the vocabulary view now (servers do it at start, in a thread)."""
        self.ll_tokenizer  # noqa: B018 -- the property builds it

    def is_special_token(self, text: str) -> bool:
        """Whether `text` is one special token to the grammar engine (a grammar names it as <text>)."""
        token_id = self._tokenizer.token_to_id(text)
        return token_id is not None and self.ll_tokenizer.is_special_token(token_id)

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` where it is one special token to the grammar engine, else None."""
        return self._tokenizer.token_to_id(text) if self.is_special_token(text) else None

    def check(self, grammar: str) -> None:
        """Raise GrammarError unless `grammar` compiles and accepts at least one text."""
        self._start_matcher(grammar)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher in the grammar's start state, for one sequence."""
        return self._start_matcher(grammar).deep_copy()

    def _start_matcher(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            m = self._compiled.get(grammar)
            if m is not None:
                self._compiled.move_to_end(grammar)
                return m
        m = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"the grammar does not compile: {_first_lines(m.get_error())}")
        probe = m.deep_copy()  # computing the first mask finds a grammar whose language is empty
        first = allowed_ids(probe.compute_bitmask(), self.vocab_size)
        if probe.is_error() or (not probe.is_accepting() and not set(first.tolist()) - set(self.eos_token_ids)):
            raise GrammarError("the grammar matches no text")
        with self._lock:
            self._compiled[grammar] = m
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return m


def allowed_ids(bitmask: bytes | np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a one-row bitmask (bit i of 32-bit word i // 32 = token i) allows."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def _first_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:n])
