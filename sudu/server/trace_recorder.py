"""`sudu serve --record-trace FILE`: a trace of the real traffic, in the sudu JSONL format that `sudu bench
replay` reads (docs/bench.md, "Trace format"). The recorder wraps the serving engine; each finished
request becomes one line: its arrival offset, prompt length, block hash ids, output length, and never its
text unless `--record-text` (then `prompt`, the rendered prompt). Hash ids are small integers standing for
a block of `block_size` prompt tokens and everything before it (equal ids = equal token prefixes).

Sessions are inferred: a request whose full blocks continue all the full blocks of a finished earlier
request, and add at least one more, is that request's next turn (`after` it, with `tool_wait_s` = the time between that answer and
this arrival); any other request starts a session of its own at its arrival offset (`at_s`)."""
from __future__ import annotations

import json
import threading
import time
from typing import AsyncIterator

BLOCK_SIZE = 512


class TraceRecorder:
    """A ServingEngine that passes everything to `engine` and writes one trace line per finished request."""

    def __init__(self, engine, path: str, record_text: bool = False, block_size: int = BLOCK_SIZE):
        self._engine = engine
        self._record_text = record_text
        self._block_size = block_size
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 -- open for the server's lifetime
        self._file.write(json.dumps({"sudu_trace": 1, "block_size": block_size}) + "\n")
        self._file.flush()
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._ids: dict[tuple, int] = {}  # (parent id, block tokens) -> hash id
        self._ends: dict[int, dict] = {}  # id of a finished request's last full block -> that request
        self._sessions = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def hash_ids(self, prompt: list[int]) -> list[int]:
        out, parent = [], -1
        for k in range(0, len(prompt), self._block_size):
            key = (parent, tuple(prompt[k:k + self._block_size]))
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return out

    def _previous_turn(self, hash_ids: list[int], full: int) -> dict | None:
        """The earlier request whose full blocks this prompt continues with at least one more full block
        (a next turn resends the conversation and adds to it; a second user of the same system prompt
        shares the first one's blocks but adds none of its own to them)."""
        for j in range(full - 2, -1, -1):
            prev = self._ends.get(hash_ids[j])
            if prev is not None:
                return prev
        return None

    async def generate(self, request_id: str, request, priority: int = 0) -> AsyncIterator:
        arrival = time.monotonic() - self._t0
        prompt = list(request.prompt_token_ids)
        tokens: dict[int, int] = {}
        finished = False
        inner = self._engine.generate(request_id, request, priority=priority)
        try:
            async for out in inner:
                for c in out.outputs:
                    tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids)
                finished = finished or (out.finished and out.error is None)
                yield out
        finally:
            if hasattr(inner, "aclose"):
                await inner.aclose()
        if finished:
            self._write(request_id, prompt, arrival, max(tokens.values(), default=0))

    def _write(self, request_id: str, prompt: list[int], arrival: float, output_length: int) -> None:
        with self._lock:
            hash_ids = self.hash_ids(prompt)
            full = len(prompt) // self._block_size
            done = time.monotonic() - self._t0
            prev = self._previous_turn(hash_ids, full)
            row = {"id": request_id, "input_length": len(prompt), "hash_ids": hash_ids,
                   "output_length": max(1, output_length)}
            if prev is not None and prev["done_s"] <= arrival:
                row.update(session=prev["session"], after=prev["id"], tool_wait_s=round(arrival - prev["done_s"], 6))
            else:
                self._sessions += 1
                row.update(session=f"s{self._sessions}", at_s=round(arrival, 6))
            if self._record_text:
                row["prompt"] = self._engine.tokenizer.decode(prompt)
            if full:
                self._ends[hash_ids[full - 1]] = {"id": request_id, "session": row["session"], "done_s": done}
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()
