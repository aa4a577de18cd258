"""Where the engine's memory goes: the weights (every distinct storage of the network's parameters and
buffers), the KV pools (allocated, and how much of them is resident: the pools commit pages as they are
written, layers/kv_cache.py zeroed_pool) and the process's resident set. Logged when the engine is ready
and exported on /metrics (sudu:memory_*)."""
from __future__ import annotations

from sudu.host.huge_pages import huge_page_bytes
from sudu.host.memory import resident_bytes, rss_bytes, storage_bytes, weight_bytes
from sudu.layers.kv_cache import pool_bytes


def kv_pool_tensors(kv_caches: list) -> list:
    return [t for c in kv_caches for t in (c.k, c.v)]


def prefault_kv(engine) -> None:
    """Commits every page of the engine's CPU KV pools now (a zero byte written per page: the pools are zero
    already, so no value changes)."""
    page = 4096
    for pool in kv_pool_tensors(engine.runner.kv_caches):
        if pool.device.type == "cpu" and pool.numel():
            pool_bytes(pool)[::page].zero_()


def kv_resident_bytes(engine) -> int:
    """Bytes of the engine's KV pools now resident (-1 off the CPU)."""
    pools = kv_pool_tensors(engine.runner.kv_caches)
    return resident_bytes(pools) if all(t.device.type == "cpu" for t in pools) else -1


def memory_report(engine) -> dict:
    """weights (the bounded head's shadow included), KV pools (allocated and resident) and the resident set, in
    bytes."""
    pools = kv_pool_tensors(engine.runner.kv_caches)
    on_cpu = all(t.device.type == "cpu" for t in pools)
    bounded = getattr(engine.runner, "bounded_head", None)  # its shadow of the output head counts as weights
    return {
        "memory_weights_bytes": weight_bytes(engine.runner.model) + (bounded.shadow_bytes() if bounded else 0),
        "memory_weights_huge_page_bytes": huge_page_bytes(getattr(engine.runner.model, "huge_page_weights", None))
        + (huge_page_bytes(bounded.huge_pages) if bounded else 0),
        "memory_kv_pool_bytes": sum(storage_bytes(pools).values()),
        "memory_kv_resident_bytes": resident_bytes(pools) if on_cpu else -1,
        "memory_rss_bytes": rss_bytes(),
    }
