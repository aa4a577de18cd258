"""The bytes of one KV block across every layer's pool: what the disk tier stores and loads.

A payload is, for each layer in order, the block's K bytes then its V bytes, exactly as the pool holds
them (float or int8 values; int8 scales are part of the namespace, not the payload), so a block loaded
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
        # per layer: a [num_blocks, block bytes] byte view of K and of V (pools are contiguous [slots, H, D])
        self.views = [(self._blocks(c.k), self._blocks(c.v)) for c in kv_caches]
        self.nbytes = sum(k.shape[1] + v.shape[1] for k, v in self.views)  # K and V may differ in width (MLA)

    def _blocks(self, pool: torch.Tensor) -> torch.Tensor:
        return pool.view(pool.shape[0] // self.block_size, -1).view(torch.uint8)

    def gather(self, global_ids: list[int], sliding_ids: list[int]) -> torch.Tensor:
        """[n, nbytes] host bytes of n blocks (sliding_ids[i]: block i's id in the sliding pool; ignored
        without one), copied out in one index_select per layer and pool."""
        n = len(global_ids)
        out = torch.empty(n, self.nbytes, dtype=torch.uint8)
        ids = {False: torch.tensor(global_ids), True: torch.tensor(sliding_ids)}
        col = 0
        for layer, (k, v) in enumerate(self.views):
            idx = ids[layer in self.sliding_layers].to(k.device)
            for pool in (k, v):
                out[:, col:col + pool.shape[1]] = pool.index_select(0, idx).cpu()
                col += pool.shape[1]
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
            for pool in (k, v):
                if block is not None:
                    pool[block].copy_(src[col:col + pool.shape[1]])
                col += pool.shape[1]
