"""This process's memory as the operating system sees it: its resident set, heap pages handed back after
loading, bytes of storages and how many of their pages are resident (mincore). Below the engine: the
engine's own accounting (engine/memory.py), huge pages (host/huge_pages.py) and layers use it."""
from __future__ import annotations

import os

import numpy as np
import torch


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
    reference counting as loading drops them, and a full collection would cost every engine its time.)"""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def storage_bytes(tensors) -> dict[int, int]:
    """data pointer -> bytes of each distinct storage behind these tensors (meta tensors and None skipped)."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the network's parameters and buffers, each shared storage counted once."""
    return sum(storage_bytes(list(model.parameters()) + list(model.buffers())).values())


def kv_pool_tensors(kv_caches: list) -> list[torch.Tensor]:
    return [t for c in kv_caches for t in (c.k, c.v)]


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of these CPU tensors' pages that are in memory (mincore over each mapping); -1 if unknown."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for ptr, nbytes in storage_bytes(tensors).items():
        start = ptr - ptr % page
        length = ptr + nbytes - start
        pages = (length + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
            return -1
        total += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page
    return total
