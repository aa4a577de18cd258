"""KV block ownership and the prefix cache: the context cache's RAM tier, continued on disk.

The pool has `num_blocks` blocks of `block_size` token slots. A sequence's block table lists its blocks
in order. Full blocks are named by stable chain ids (cache/block_hash.py: parent id + token ids, rooted
in the engine's namespace), so an id names a whole prefix; blocks are shared by reference count. A block
whose count drops to zero goes to the free list but keeps its id and contents: it is a cache entry until
it is reallocated. The free list is LRU-ordered (least recently freed is reused first), which is the RAM
tier's eviction policy.

With a disk tier (cache/disk_store.py) every block is written through when it is committed (its bytes
copied out in the engine thread, written by the store's thread), and a prefix lookup that runs out of RAM
hits continues on disk, loading blocks straight into fresh pool blocks.

Models with sliding-window layers (Gemma 3) keep those layers in a pool of their own by default
(SlidingWindowBlocks): a sequence holds only the blocks its next query can see, and releases the rest,
which stay cached under the same ids. A prefix point is usable when every global block before it and the
sliding blocks inside its window are cached (vLLM's hybrid allocator, DeepSeek's prefix units), in RAM or
on disk.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from sudu.cache.block_hash import HASH_BYTES, block_hash, block_key
from sudu.cache.block_io import KVBlockIO
from sudu.cache.context import engine_namespace, open_disk_store
from sudu.cache.disk_store import DiskStats
from sudu.engine.sequence import Sequence

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = bytes(HASH_BYTES)  # for pools whose ids never leave the process (the draft model's)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()  # kept to rule out id collisions


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found, any tier
    disk_hits: int = 0  # of those, loaded from disk


class BlockPool:
    """One pool's blocks: reference counts, the LRU free list, and the id -> block map of cached blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, h: bytes, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(h)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def allocate(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evicted
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def register(self, block_id: int, h: bytes, token_ids: tuple[int, ...]) -> None:
        block = self.blocks[block_id]
        if block.hash is None:
            block.hash, block.token_ids = h, token_ids
            self.cached.setdefault(h, block_id)


class SlidingWindowBlocks:
    """The KV blocks of sliding-window layers (Gemma's local layers), in a pool of their own. A sequence's
    `sliding_block_table` has an entry per block of its positions, None where it holds nothing: before
    each step it releases the blocks its first new token can no longer see, so these layers hold at most
    `ring_blocks` blocks per sequence (the window plus one step's chunk) whatever its length. Released
    full blocks keep their ids, so a later request can reuse a cached window."""

    def __init__(self, num_blocks: int, block_size: int, window: int, max_step_tokens: int):
        self.block_size = block_size
        self.window = window
        self.ring_blocks = self.ring_len(block_size, window, max_step_tokens)
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks)

    @staticmethod
    def ring_len(block_size: int, window: int, max_step_tokens: int) -> int:
        """Most blocks one sequence holds: a step writes up to max_step_tokens new positions while its
        first query still needs the window before it."""
        return -(-(window + max_step_tokens) // block_size) + 1

    def first_block(self, position: int) -> int:
        """The first block a query at this position sees."""
        return max(0, position + 1 - self.window) // self.block_size

    def _span(self, seq: Sequence, total: int) -> range:
        return range(self.first_block(seq.num_computed_tokens), -(-total // self.block_size))

    def needed(self, seq: Sequence, total: int) -> int:
        """Blocks to take from the free list to hold positions up to total, less those the sequence is
        about to release."""
        table = seq.sliding_block_table
        missing = sum(1 for b in self._span(seq, total) if b >= len(table) or table[b] is None)
        first = self.first_block(seq.num_computed_tokens)
        return missing - sum(1 for b in table[:first] if b is not None)

    def allocate(self, seq: Sequence, total: int) -> None:
        table = seq.sliding_block_table
        span = self._span(seq, total)
        for b in range(min(span.start, len(table))):
            if table[b] is not None:
                self.pool.release(table[b])
                table[b] = None
        table.extend([None] * (span.stop - len(table)))
        for b in span:
            if table[b] is None:
                table[b] = self.pool.allocate()

    def trim(self, seq: Sequence, num_blocks: int) -> None:
        table = seq.sliding_block_table
        while len(table) > num_blocks:
            block_id = table.pop()
            if block_id is not None:
                self.pool.release(block_id)

    def free_sequence(self, seq: Sequence) -> None:
        self.trim(seq, 0)

    def num_held(self, seq: Sequence) -> int:
        return sum(1 for b in seq.sliding_block_table if b is not None)

    def slots(self, seq: Sequence, start: int, end: int):
        """Pool slots of positions start..end-1 (a torch LongTensor)."""
        import torch

        pos = torch.arange(start, end)
        table = torch.tensor([-1 if b is None else b for b in seq.sliding_block_table], dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding: SlidingWindowBlocks | None = None, namespace: bytes = DEFAULT_NAMESPACE,
                 disk=None, block_io=None):
        """disk: a cache.disk_store.DiskKVStore (or None: RAM only); block_io: the cache.block_io.KVBlockIO
        over this engine's pools, required with disk."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.stats = PrefixCacheStats()
        self.sliding = sliding
        self.namespace = namespace
        self.disk = disk if enable_prefix_caching else None
        self.block_io = block_io

    @property
    def blocks(self) -> list[Block]:
        return self.pool.blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- ids ---------------------------------------------------------------------------------------
    def _block_ids(self, seq: Sequence, b: int) -> tuple[int, ...]:
        """What block b's id is hashed from and checked against: its token ids, and the content hash of any
        image whose placeholder tokens fall in it (cache/block_hash.py block_key)."""
        return block_key(seq.token_ids, b, self.block_size, seq.images)

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Ids of the sequence's first num_blocks full blocks (memoised on the sequence: its tokens only
        ever grow)."""
        out = seq.block_hashes
        while len(out) < num_blocks:
            out.append(block_hash(out[-1] if out else self.namespace, self._block_ids(seq, len(out))))
        return out[:num_blocks]

    def _parent(self, hashes: list[bytes], b: int) -> bytes:
        return hashes[b - 1] if b else self.namespace

    # ---- prefix lookup -----------------------------------------------------------------------------
    def cached_prefix_tokens(self, token_ids: list[int], images: tuple = ()) -> int:
        """Tokens of the leading full blocks of a prompt that a prefix lookup would find now, in RAM or in
        the disk tier's index, without taking them: an estimate for scheduling and admission (an entry may
        be evicted before the sequence runs). Reads only, so any thread may call it."""
        if not self.enable_prefix_caching:
            return 0
        num_full = (len(token_ids) - 1) // self.block_size
        parent, found = self.namespace, 0
        for b in range(num_full):
            ids = block_key(token_ids, b, self.block_size, images)
            parent = block_hash(parent, ids)
            if self.pool.lookup(parent, ids) is None and not (self.disk is not None and self.disk.has(parent)):
                break
            found += 1
        return found * self.block_size

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the longest cached run of its full blocks, from RAM, then disk.
        At least one token is always left to compute, since the model must produce logits for the last
        one. Returns the number of tokens served from the cache (seq.disk_hit_tokens of them loaded from
        disk)."""
        assert not seq.block_table
        seq.num_computed_tokens = seq.disk_hit_tokens = 0
        if not self.enable_prefix_caching:
            return 0
        num_full = (seq.num_tokens - 1) // self.block_size
        hashes = self.hashes(seq, num_full)
        limit = num_full
        while True:
            ram, n = self._plan(seq, hashes, limit)
            got = self._take_prefix(seq, hashes, ram, n)
            if got == n:
                break
            seq.disk_hit_tokens = 0
            self.free_sequence(seq)  # a disk file failed its checks or the pool ran dry: plan again, shorter
            limit = got
        if self.disk is not None and n:
            self.disk.touch([(hashes[b], self._parent(hashes, b)) for b in reversed(range(n))
                             if self.disk.has(hashes[b])])
        seq.num_computed_tokens = n * self.block_size
        seq.num_hashed_blocks = n
        return seq.num_computed_tokens

    def _plan(self, seq: Sequence, hashes: list[bytes], limit: int) -> tuple[int, int]:
        """(blocks found in RAM, usable prefix length in blocks) at most limit long."""
        ram = 0
        while ram < limit and self.pool.lookup(hashes[ram], self._block_ids(seq, ram)) is not None:
            ram += 1
        n = ram
        if self.disk is not None:
            while n < limit and self.disk.contains(hashes[n], self._parent(hashes, n)):
                n += 1
        if self.sliding is not None:
            while n > 0 and not all(self._sliding_available(seq, hashes, b)
                                    for b in range(self.sliding.first_block(n * self.block_size), n)):
                n -= 1
        return min(ram, n), n

    def _sliding_available(self, seq: Sequence, hashes: list[bytes], b: int) -> bool:
        if self.sliding.pool.lookup(hashes[b], self._block_ids(seq, b)) is not None:
            return True
        return self.disk is not None and self.disk.contains(hashes[b], self._parent(hashes, b))

    def _take_prefix(self, seq: Sequence, hashes: list[bytes], ram: int, n: int) -> int:
        """Take blocks 0..n-1 (the first `ram` from RAM, the rest loaded from disk) and, with a sliding
        pool, the window's sliding blocks. Returns n, or the first block that could not be had."""
        for b in range(ram):
            block_id = self.pool.lookup(hashes[b], self._block_ids(seq, b))
            self.pool.take(block_id)
            seq.block_table.append(block_id)
        window = range(self.sliding.first_block(n * self.block_size), n) if self.sliding is not None else range(0)
        sliding_table = seq.sliding_block_table
        if self.sliding is not None:
            sliding_table.extend([None] * n)
            for b in window:  # RAM hits first, so loads below cannot evict them
                block_id = self.sliding.pool.lookup(hashes[b], self._block_ids(seq, b))
                if block_id is not None:
                    self.sliding.pool.take(block_id)
                    sliding_table[b] = block_id
        start = time.perf_counter()
        try:
            for b in range(n):
                need_global = b >= ram
                need_sliding = b in window and sliding_table[b] is None
                if not (need_global or need_sliding):
                    continue
                if not self._load(seq, hashes, b, need_global, need_sliding):
                    return b
        finally:
            seq.disk_load_s += time.perf_counter() - start
        return n

    def _load(self, seq: Sequence, hashes: list[bytes], b: int, need_global: bool, need_sliding: bool) -> bool:
        if (need_global and self.pool.num_free == 0) or (need_sliding and self.sliding.pool.num_free == 0):
            return False
        ids = self._block_ids(seq, b)
        payload = self.disk.load(hashes[b], self._parent(hashes, b), ids)
        if payload is None:
            return False
        global_id = sliding_id = None
        if need_global:
            global_id = self.pool.allocate()
            self.pool.register(global_id, hashes[b], ids)
            seq.block_table.append(global_id)
            seq.disk_hit_tokens += self.block_size
        if need_sliding:
            sliding_id = self.sliding.pool.allocate()
            self.sliding.pool.register(sliding_id, hashes[b], ids)
            seq.sliding_block_table[b] = sliding_id
        self.block_io.scatter(payload, global_id, sliding_id)
        return True

    # ---- allocation ----------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = seq.num_computed_tokens + num_new_tokens
        if self.sliding is not None and self.sliding.needed(seq, total) > self.sliding.pool.num_free:
            return False
        return self.blocks_needed(total) - len(seq.block_table) <= self.pool.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend the block table(s) to hold num_computed_tokens + num_new_tokens tokens."""
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError("allocate called without can_allocate")
        total = seq.num_computed_tokens + num_new_tokens
        for _ in range(self.blocks_needed(total) - len(seq.block_table)):
            seq.block_table.append(self.pool.allocate())
        if self.sliding is not None:
            self.sliding.allocate(seq, total)

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache, and write them through to
        disk."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_hashed_blocks
        if num_full <= start:
            return
        hashes = self.hashes(seq, num_full)
        fresh = []
        for b in range(start, num_full):
            ids = self._block_ids(seq, b)
            block_id = seq.block_table[b]
            if self.pool.blocks[block_id].hash is None:
                fresh.append(b)
            self.pool.register(block_id, hashes[b], ids)
            if self.sliding is not None and seq.sliding_block_table[b] is not None:
                self.sliding.pool.register(seq.sliding_block_table[b], hashes[b], ids)
        seq.num_hashed_blocks = num_full
        if self.disk is not None and fresh:
            self._write_through(seq, hashes, fresh)

    def _write_through(self, seq: Sequence, hashes: list[bytes], fresh: list[int]) -> None:
        todo = [b for b in fresh if not self.disk.has(hashes[b])
                and (self.sliding is None or seq.sliding_block_table[b] is not None)]
        if not todo:
            return
        sliding_ids = [seq.sliding_block_table[b] for b in todo] if self.sliding is not None else [0] * len(todo)
        payloads = self.block_io.gather([seq.block_table[b] for b in todo], sliding_ids)
        for row, b in enumerate(todo):
            self.disk.put(hashes[b], self._parent(hashes, b), self._block_ids(seq, b), payloads[row])

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens (rejected speculative tokens)."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self.pool.release(seq.block_table.pop())
        if self.sliding is not None:
            self.sliding.trim(seq, keep)

    def free_sequence(self, seq: Sequence) -> None:
        # tail blocks first, so they are evicted before the (more shareable) head of the prefix
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        seq.block_table = []
        if self.sliding is not None:
            self.sliding.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    # ---- blocks that arrive or leave as bytes (a prefill replica's handoff, cluster/handoff.py) ---------------
    def cached_run(self, hashes: list[bytes], token_blocks: list[tuple[int, ...]]) -> list[int]:
        """Pool ids of the leading run of these blocks (ids and their tokens) that the RAM tier holds."""
        found = []
        for h, ids in zip(hashes, token_blocks):
            block_id = self.pool.lookup(h, ids)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def cache_block(self, h: bytes, token_ids: tuple[int, ...], payload) -> bool:
        """Write one block's bytes (KVBlockIO's layout) into a free pool block, registered under its id and
        left free, so a prefix match takes it. False when the RAM tier holds it already or has no free
        block; global pools only (no sliding-window pool)."""
        if self.pool.lookup(h, token_ids) is not None or self.pool.num_free == 0:
            return False
        block_id = self.pool.allocate()
        self.pool.register(block_id, h, token_ids)
        self.block_io.scatter(payload, block_id, None)
        self.pool.release(block_id)
        return True

    def cached_block_ids(self) -> list[bytes]:
        """Ids of every block a prefix lookup can find now, RAM and disk tiers together (a replica's cache
        summary for the router). Safe from another thread: tuple() copies the dict in one step."""
        ram = tuple(self.pool.cached)
        return list(ram) + (self.disk.block_ids() if self.disk is not None else [])

    # ---- the disk tier's upkeep -------------------------------------------------------------------------
    def disk_stats(self) -> dict:
        """The disk tier's counters under /metrics names (zeros without one)."""
        d = self.disk.stats if self.disk is not None else DiskStats()
        return {
            "disk_cache_enabled": int(self.disk is not None),
            "disk_cache_bytes": self.disk.total_bytes if self.disk is not None else 0,
            "disk_cache_blocks": self.disk.num_blocks if self.disk is not None else 0,
            **{f"disk_cache_{k}": v for k, v in dataclasses.asdict(d).items()},
        }

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def build_block_manager(config, ckpt, weight_format: str, runner):
    """The engine's block manager with its context cache: ids rooted in this engine's namespace, and the
    disk tier when config asks for one (and the directory can hold it)."""
    namespace, description = engine_namespace(config, ckpt.config, ckpt.path, weight_format, runner.kv_caches,
                                              runner.dtype, runner.device)
    block_io = KVBlockIO(runner.kv_caches, runner.ring_layers, config.block_size)
    disk = open_disk_store(config, namespace, block_io.nbytes, description) if config.enable_prefix_caching else None
    return BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching,
                        sliding=runner.sliding_blocks, namespace=namespace, disk=disk, block_io=block_io)
