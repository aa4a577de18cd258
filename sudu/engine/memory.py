"""Where the engine's memory goes: the weights (every distinct storage of the network's parameters and
buffers), the KV pools (allocated, and how much of them is resident: the pools commit pages as they are
written, layers/kv_cache.py zeroed_pool) and the process's resident set. Logged when the engine is ready
and exported on /metrics (sudu:memory_*)."""
from __future__ import annotations

import os

import numpy as np
import torch

from sudu.engine.huge_pages import huge_page_bytes


def rss_bytes() -> int:
    """This process's resident set (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_freed_memory() -> None:
    """Give the heap pages that loading freed (the float copies the format check and dequantization made)
    back to the system: glibc keeps freed memory in its arenas, resident, until asked (malloc_trim).
    A no-op where the C library has no malloc_trim. (No gc.collect first: the float copies are freed by
    reference counting as loading drops them, and a full collection costs ~0.1 s per engine.)"""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _storages(tensors) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the network's parameters and buffers, each shared storage counted once."""
    return sum(_storages(list(model.parameters()) + list(model.buffers())).values())


def kv_pool_tensors(kv_caches: list) -> list[torch.Tensor]:
    return [t for c in kv_caches for t in (c.k, c.v)]


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of these CPU tensors' pages that are in memory (mincore over each mapping); -1 if unknown."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for ptr, nbytes in _storages(tensors).items():
        start = ptr - ptr % page
        length = ptr + nbytes - start
        pages = (length + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
            return -1
        total += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page
    return total


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
        "memory_kv_pool_bytes": sum(_storages(pools).values()),
        "memory_kv_resident_bytes": resident_bytes(pools) if on_cpu else -1,
        "memory_rss_bytes": rss_bytes(),
    }
