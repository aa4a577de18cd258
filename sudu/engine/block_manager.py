"""KV block ownership and the prefix cache.

The pool has `num_blocks` blocks of `block_size` token slots. A sequence's block table lists its blocks
in order. Full blocks are identified by a chain hash (parent block's hash + this block's token ids), so a
hash names a whole prefix; blocks are shared by reference count. A block whose count drops to zero goes
to the free list but keeps its hash and contents: it is a cache entry until it is reallocated. The free
list is LRU-ordered (least recently freed is reused first), which is the cache's eviction policy.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from sudu.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept to rule out hash collisions


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class SlidingWindowBlocks:
    """The KV blocks of sliding-window layers (Gemma's local layers). Each sequence gets a ring of at most
    `ring_blocks` blocks: position p lives in ring block (p // block_size) % ring_blocks, so these layers
    hold only the last window (plus one step's chunk) of every sequence, whatever its length. A ring
    cannot serve a reused prefix (its window's keys were overwritten or never written for this
    sequence), so the engine turns the prefix cache off when it uses one."""

    def __init__(self, num_blocks: int, block_size: int, window: int, max_step_tokens: int):
        self.block_size = block_size
        self.window = window
        self.ring_blocks = self.ring_len(block_size, window, max_step_tokens)
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    @staticmethod
    def ring_len(block_size: int, window: int, max_step_tokens: int) -> int:
        """Blocks in one sequence's ring. A step writes up to max_step_tokens new positions while its
        first query still needs the window before it: the ring must span both without overwriting a
        live key."""
        return -(-(window + max_step_tokens) // block_size) + 1

    def needed(self, seq: Sequence, num_tokens: int) -> int:
        return min(self.ring_blocks, -(-num_tokens // self.block_size)) - len(seq.sliding_block_table)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.needed(seq, num_tokens)):
            seq.sliding_block_table.append(self.free.pop())

    def free_sequence(self, seq: Sequence) -> None:
        self.free.extend(reversed(seq.sliding_block_table))
        seq.sliding_block_table = []

    def slots(self, seq: Sequence, start: int, end: int):
        """Ring slots of positions start..end-1 (a torch LongTensor)."""
        pos = torch.arange(start, end)
        table = torch.tensor(seq.sliding_block_table, dtype=torch.long)
        return table[(pos // self.block_size) % self.ring_blocks] * self.block_size + pos % self.block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding: SlidingWindowBlocks | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.stats = PrefixCacheStats()
        self.sliding = sliding
        if sliding is not None:
            self.enable_prefix_caching = False

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
        return block

    def _allocate_fresh(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evicted
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the longest cached run of its full blocks. At least one token
        is always left to compute, since the model must produce logits for the last one. Returns the
        number of tokens served from the cache."""
        assert not seq.block_table
        num_full = (seq.num_tokens - 1) // self.block_size
        if not self.enable_prefix_caching:
            return 0
        parent = None
        for b in range(num_full):
            ids = tuple(seq.token_ids[b * self.block_size:(b + 1) * self.block_size])
            h = chain_hash(parent, ids)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != ids:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            parent = h
        seq.num_hashed_blocks = len(seq.block_table)
        hit = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = hit
        return hit

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = seq.num_computed_tokens + num_new_tokens
        if self.sliding is not None and self.sliding.needed(seq, total) > len(self.sliding.free):
            return False
        return self.blocks_needed(total) - len(seq.block_table) <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend the block table(s) to hold num_computed_tokens + num_new_tokens tokens."""
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError("allocate called without can_allocate")
        total = seq.num_computed_tokens + num_new_tokens
        for _ in range(self.blocks_needed(total) - len(seq.block_table)):
            seq.block_table.append(self._allocate_fresh())
        if self.sliding is not None:
            self.sliding.allocate(seq, total)

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_hashed_blocks
        parent = self.blocks[seq.block_table[start - 1]].hash if start else None
        for b in range(start, num_full):
            block = self.blocks[seq.block_table[b]]
            if block.hash is None:
                ids = tuple(seq.token_ids[b * self.block_size:(b + 1) * self.block_size])
                block.hash, block.token_ids = chain_hash(parent, ids), ids
                self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash
        seq.num_hashed_blocks = max(start, num_full)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens (rejected speculative tokens)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def free_sequence(self, seq: Sequence) -> None:
        # tail blocks first, so they are evicted before the (more shareable) head of the prefix
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        if self.sliding is not None:
            self.sliding.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
