"""The bytes of one KV block across every layer's pool: what the disk tier stores and loads.

A payload is, for each layer in order, the block's K values then its V values slot by slot, as the pool
holds them (float or int8 values; int8 scales are part of the namespace, not the payload; slot-major
whatever the pool's own layout), so a block loaded
from disk computes exactly what the block computed when it was in RAM. Global layers address the block
by its id in the main pool; sliding-window layers with their own pool (Gemma's local layers in the
default layout) by the id of the sequence's sliding block for the same positions.
"""
from __future__ import annotations

import torch


class KVBlockIO:
    def __init__(self, kv_caches: list, sliding_layers: set[int], block_size: int):
        self.sliding_layers = sliding_layers  # layers whose pool is the sliding pool (empty: one pool)
        self.block_size = block_size
        # per layer: K and V as [num_blocks, block_size, H, D] views of the pools (whatever their layout: the
        # CPU keeps each head's rows together, layers/kv_cache.py kv_pool); a block's payload is its values in
        # that order, slot by slot, so the bytes on disk do not depend on the pool's layout
        self.views = [(self._blocks(c.k), self._blocks(c.v)) for c in kv_caches]
        self.widths = [(self._width(k), self._width(v)) for k, v in self.views]
        self.nbytes = sum(wk + wv for wk, wv in self.widths)  # K and V may differ in width (MLA)

    def _blocks(self, pool: torch.Tensor) -> torch.Tensor:
        return pool.unflatten(0, (pool.shape[0] // self.block_size, self.block_size))

    @staticmethod
    def _width(blocks: torch.Tensor) -> int:
        return blocks[0].numel() * blocks.element_size()

    def gather(self, global_ids: list[int], sliding_ids: list[int]) -> torch.Tensor:
        """[n, nbytes] host bytes of n blocks (sliding_ids[i]: block i's id in the sliding pool; ignored
        without one), copied out in one index_select per layer and pool."""
        n = len(global_ids)
        out = torch.empty(n, self.nbytes, dtype=torch.uint8)
        ids = {False: torch.tensor(global_ids), True: torch.tensor(sliding_ids)}
        col = 0
        for layer, (k, v) in enumerate(self.views):
            idx = ids[layer in self.sliding_layers].to(k.device)
            for pool, width in zip((k, v), self.widths[layer]):
                values = pool.index_select(0, idx).reshape(n, width // pool.element_size())
                out[:, col:col + width] = values.view(torch.uint8).cpu()
                col += width
        return out

    def scatter(self, payload, global_id: int | None, sliding_id: int | None) -> None:
        """Copy one block's payload (bytes-like, nbytes long) into the pools: the global layers' part into
        main-pool block global_id and the sliding layers' part into sliding block sliding_id; a part
        whose id is None is skipped (that pool already holds it, or its positions are outside the
        window)."""
        src = torch.frombuffer(payload, dtype=torch.uint8)
        col = 0
        for layer, (k, v) in enumerate(self.views):
            block = sliding_id if layer in self.sliding_layers else global_id
            for pool, width in zip((k, v), self.widths[layer]):
                if block is not None:
                    pool[block].copy_(src[col:col + width].view(pool.dtype).view(pool.shape[1:]))
                col += width
