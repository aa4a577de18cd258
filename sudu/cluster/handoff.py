"""Prefill/decode handoff (`sudu serve --pd P:D`): a prompt's KV blocks leave the prefill replica's pool
and enter the decode replica's prefix cache, so decoding starts there as on a cache hit.

The prefill replica runs the request for one token, which leaves the prompt's full blocks committed in its
prefix cache; `export_prompt_blocks` copies them out (KVBlockIO, the disk tier's payload layout) in the
engine thread. The payload goes back through Ray (returned from the replica's method, it lives in Ray's
object store: shared memory on one node, Ray's transfer between nodes) and the ingress hands the reference,
not the bytes, to the decode replica. `import_prompt_blocks` writes each block into a free pool block
under the same stable id (cache/block_hash.py: both replicas share the namespace), registered in the
prefix cache and released, so the request's own prefix match takes them. The decode replica then
computes only the prompt's last partial block and samples from there: its greedy output is the unified
engine's. A block the decode replica already holds is not written again.

Models whose sliding-window layers have a pool of their own (Gemma 3) are not handed off: their windows
would need the sliding blocks too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from sudu.cache.block_hash import prefix_hashes

log = logging.getLogger(__name__)


@dataclass
class Handoff:
    """What the prefill replica returns: the prompt's leading full blocks and where they came from."""

    payload: np.ndarray  # [blocks, KVBlockIO.nbytes] uint8
    prefill_replica: str
    prefill_s: float  # the prefill replica's time for the request (queue + prompt + one token)
    export_s: float  # copying the blocks out of the pool
    sent_at: float  # time.time() when it left the prefill replica
    # the prefill engine's context-cache namespace: blocks are only valid in an engine with the same one
    # (weights, weight format, KV format and scales: cache/context.py engine_namespace)
    namespace: bytes = b""

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)


def _prompt_blocks(engine, token_ids: list[int]) -> tuple[list[bytes], list[tuple[int, ...]]]:
    bm = engine.block_manager
    bs = bm.block_size
    n = (len(token_ids) - 1) // bs  # the prefix match always leaves the last token to compute
    ids = [tuple(token_ids[b * bs:(b + 1) * bs]) for b in range(n)]
    return prefix_hashes(bm.namespace, token_ids, bs, n), ids


def check_handoff_supported(engine) -> None:
    if engine.block_manager.sliding is not None:
        raise ValueError("--pd does not hand off models with a sliding-window KV pool (Gemma 3); serve them "
                         "with --replicas")
    if not engine.config.enable_prefix_caching:
        raise ValueError("--pd needs prefix caching: the decode replica takes the prompt's blocks as a cache hit")


def export_prompt_blocks(engine, token_ids: list[int]) -> np.ndarray:
    """The leading run of the prompt's full blocks found in the prefix cache, as bytes. Engine thread."""
    bm = engine.block_manager
    found = bm.cached_run(*_prompt_blocks(engine, token_ids))
    return bm.block_io.gather(found, found).numpy()


def import_prompt_blocks(engine, token_ids: list[int], payload: np.ndarray, namespace: bytes = b"") -> int:
    """Write the handed-off blocks into the prefix cache; returns how many were written (blocks already
    cached here are kept as they are). Engine thread, before the request is added. Blocks from an engine
    with another namespace (say another KV format: the two replicas' load-time checks disagreed) are not
    taken: this engine computes the prompt itself, and says so in its log."""
    bm = engine.block_manager
    if namespace and namespace != bm.namespace:
        log.warning("handoff blocks come from an engine with another KV namespace (%s, here %s): the prompt "
                    "is computed here", namespace.hex(), bm.namespace.hex())
        return 0
    if payload.shape[0] and payload.shape[1] != bm.block_io.nbytes:
        raise ValueError(f"handoff blocks of {payload.shape[1]} bytes, this engine's are {bm.block_io.nbytes}")
    hashes, ids = _prompt_blocks(engine, token_ids)
    written = 0
    for b in range(min(len(hashes), payload.shape[0])):
        if bm.cache_block(hashes[b], ids[b], np.ascontiguousarray(payload[b])):
            written += 1
        elif bm.pool.num_free == 0:
            break
    return written


def handoff_route(handoff: Handoff, imported_blocks: int, import_s: float, received_at: float) -> dict:
    """The handoff's figures for the response's `sudu` extension."""
    return {"prefill_replica": handoff.prefill_replica, "handoff_bytes": handoff.nbytes,
            "handoff_blocks": int(handoff.payload.shape[0]), "handoff_imported_blocks": imported_blocks,
            "handoff_s": round(max(0.0, received_at - handoff.sent_at) + import_s + handoff.export_s, 6),
            "prefill_replica_s": round(handoff.prefill_s, 6)}
