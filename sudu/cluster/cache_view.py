"""What the router knows of each replica's context cache, and the choice it makes from it. No Ray here,
so the policy is tested on its own.

A replica reports a compact summary of the blocks it holds (`summarize`): the first 8 bytes of each
cached block id (cache/block_hash.py), RAM and disk tier together, as a sorted uint64 array, with a
version that changes only when the set does. The router keeps one `ReplicaCache` per replica: the last
summary, plus the blocks of requests it has sent there since ("pending": they are being computed and
will be cached, so the next turn of a conversation follows its first before the replica reports
again). A new summary replaces the old one, so an evicted block leaves the view with the next report;
pending blocks leave when a summary contains them or after `pending_ttl_s`.

Ids are chains (an id names its whole prefix), so the predicted hit on a replica is the longest run of
the prompt's leading block ids found in its view. 8 bytes of a 16-byte id: a false match needs a
64-bit collision, and costs only a worse route (the engine checks every block's tokens before use).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sudu.cache.block_hash import prefix_hashes

SUMMARY_ID_BYTES = 8


def short_id(block_id: bytes) -> int:
    return int.from_bytes(block_id[:SUMMARY_ID_BYTES], "little")


def summarize(block_ids) -> bytes:
    """The compact form of a set of block ids: sorted little-endian uint64 prefixes."""
    return np.unique(np.fromiter((short_id(h) for h in block_ids), dtype="<u8")).tobytes()


def expand(summary: bytes) -> set[int]:
    return set(np.frombuffer(summary, dtype="<u8").tolist())


def prompt_block_ids(namespace: bytes, token_ids, block_size: int) -> list[int]:
    """Short ids of the prompt's full blocks that a prefix lookup can use (the last token is always
    computed, as in BlockManager.match_prefix)."""
    num_full = max(0, (len(token_ids) - 1) // block_size)
    return [short_id(h) for h in prefix_hashes(namespace, token_ids, block_size, num_full)]


@dataclass
class ReplicaCache:
    version: int = -1
    reported: set[int] = field(default_factory=set)
    pending: dict[int, float] = field(default_factory=dict)  # short id -> when it was sent here

    def update(self, version: int, summary: bytes) -> None:
        if version == self.version:
            return
        self.version = version
        self.reported = expand(summary)
        for h in [h for h in self.pending if h in self.reported]:
            del self.pending[h]

    def add_pending(self, ids: list[int], now: float) -> None:
        for h in ids:
            if h not in self.reported:
                self.pending[h] = now

    def expire(self, now: float, ttl_s: float) -> None:
        for h in [h for h, t in self.pending.items() if now - t > ttl_s]:
            del self.pending[h]

    def hit_blocks(self, ids: list[int]) -> int:
        n = 0
        for h in ids:
            if h not in self.reported and h not in self.pending:
                break
            n += 1
        return n


@dataclass
class Choice:
    order: list[str]  # replica keys, most preferred first
    predicted_blocks: dict[str, int]  # per replica
    reason: str  # "prefix", "least_loaded" (no replica holds a prefix), "load_guard", "round_robin"


def choose(ids: list[int], caches: dict[str, ReplicaCache], loads: dict[str, int], imbalance_threshold: int,
           tie_break: int = 0) -> Choice:
    """Cache-aware choice among replicas (keys of `loads`): the longest predicted prefix hit, unless that
    replica has more than imbalance_threshold requests in flight beyond the least loaded one, which then
    gets the request. Ties (equal hits) go to the less loaded; tie_break rotates among equals."""
    keys = list(loads)
    predicted = {k: caches[k].hit_blocks(ids) if k in caches else 0 for k in keys}
    rot = {k: (i - tie_break) % len(keys) for i, k in enumerate(keys)}
    by_load = sorted(keys, key=lambda k: (loads[k], rot[k]))
    least = by_load[0]
    best = sorted(keys, key=lambda k: (-predicted[k], loads[k], rot[k]))
    if predicted[best[0]] == 0:
        return Choice(by_load, predicted, "least_loaded")
    if loads[best[0]] - loads[least] > imbalance_threshold:
        return Choice(by_load, predicted, "load_guard")
    return Choice(best, predicted, "prefix")

