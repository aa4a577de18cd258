"""The Responses API's memory of past responses (`store: true`, `previous_response_id`): in process
memory, bounded by a number of entries and an age, least recently used first out. A continued
conversation sends only its new items; the stored conversation (the chat messages of every earlier
turn, the answer included, rendered later by the same chat template) makes the prompt, and since it
renders the same tokens as before, the context cache serves the earlier turns.

Entries hold the conversation as chat messages and the response body as answered (GET /v1/responses/{id}).
Thread-safe: lookups run on the event loop, writes after a response finishes."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_AGE_S = 3600.0


@dataclass
class StoredResponse:
    messages: list[dict]  # the whole conversation up to and including this response's answer
    body: dict  # the response object as it was returned
    stored_at: float


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock=time.monotonic):
        if max_entries < 1 or max_age_s <= 0:
            raise ValueError("the response store needs room for one entry and a positive age limit")
        self.max_entries, self.max_age_s, self._clock = max_entries, max_age_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict], body: dict) -> None:
        with self._lock:
            self._entries[response_id] = StoredResponse(messages, body, self._clock())
            self._entries.move_to_end(response_id)
            self._expire()
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when unknown, evicted or older than the age limit."""
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _expire(self) -> None:
        """Drop entries past the age limit (oldest stored first; a get does not renew an entry's age)."""
        cutoff = self._clock() - self.max_age_s
        stale = [key for key, entry in self._entries.items() if entry.stored_at < cutoff]
        for key in stale:
            del self._entries[key]
