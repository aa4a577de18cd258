"""The promises behind Retry-After: a refused request is told when to come back, and its place is kept.

A refused request's promise holds its first arrival (so, back in time, it is queued from there, ahead of
later arrivals) and its load. Until its Retry-After has passed by `grace_s`, the promise stands; after
that it expires (the client did not come back).

Promised work counts ahead of later arrivals from shortly before it is due (`horizon_s`: the limit of the
wait that admission holds), so that the requests admitted meanwhile do not fill the room a returning
client was promised. A client that never returns would then hold room for nothing, and with clients that
never retry each refusal would block the next arrivals in turn, so promised work counts only in the share
that clients have been seen to keep: the show rate, a moving average of promises redeemed (1) and
expired (0). Clients that always come back are given their room; clients that never do cost nothing
after a few expiries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sudu.engine.wait_predictor import SeqLoad

INITIAL_SHOW_RATE = 0.5  # before any promise was redeemed or expired
SHOW_RATE_ALPHA = 0.1


@dataclass(frozen=True)
class Promise:
    due: float  # when the client was told to come back
    arrival: float  # its first arrival: where it is queued from when it returns
    loads: tuple[SeqLoad, ...]
    turn: float = 0.0  # its place in the virtual queue (next_turn); due is this rounded up to whole seconds


class PromiseBook:
    """Promises by request key (what identifies the same request sent again). Not thread-safe: the caller
    holds its admission lock."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.show_rate = INITIAL_SHOW_RATE
        self._promises: dict[int, Promise] = {}
        self.kept = 0  # promises redeemed: the client came back in time
        self.expired = 0

    def __len__(self) -> int:
        return len(self._promises)

    def _observe(self, showed: bool) -> None:
        self.show_rate += SHOW_RATE_ALPHA * (float(showed) - self.show_rate)

    def expire(self, now: float) -> None:
        for key, promise in list(self._promises.items()):
            if now > promise.due + self.grace_s:
                del self._promises[key]
                self.expired += 1
                self._observe(False)

    def redeem(self, key: int) -> Promise | None:
        """The promise made to this request, taken out of the book (None: there is none)."""
        promise = self._promises.pop(key, None)
        if promise is not None:
            self.kept += 1
            self._observe(True)
        return promise

    def keep(self, key: int, promise: Promise) -> None:
        self._promises[key] = promise

    def next_turn(self, now: float, drain_s: float, step_s: float) -> float:
        """The turn to promise a request refused now: when the queue ahead of it (the engine's and every
        standing promise's work) is predicted to have drained, and no sooner than `step_s` (its own share of
        the engine's time) after the latest turn still promised. The turns are a virtual queue: they come in
        the order of the refusals, spaced at the rate the engine serves, so returning clients never come back
        in a crowd when the drain estimate dips; when it rises, the queue moves later, never earlier."""
        latest = max((p.turn for p in self._promises.values()), default=-math.inf)
        return max(now + drain_s, latest + step_s)

    def ahead(self, now: float, horizon_s: float) -> tuple[SeqLoad, ...]:
        """The promised loads to count in the queue now: those due within horizon_s, earliest due first, in
        the share the show rate says will come back."""
        due = sorted((p for p in self._promises.values() if p.due <= now + horizon_s), key=lambda p: p.due)
        counted = due[:round(len(due) * self.show_rate)]
        return tuple(s for p in counted for s in p.loads)
