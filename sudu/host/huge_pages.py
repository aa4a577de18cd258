"""The network's weights moved into memory backed by transparent huge pages (2 MiB), on Linux CPUs.

A decode step streams every weight once, so its speed is the rate at which the cores draw the weights
from memory. In 4 KiB pages that stream crosses a page boundary every 4 KiB: a TLB miss each time, and
the hardware prefetchers stop at the boundary. Kernels this project's machines run default to THP
`madvise`, where ordinary allocations (torch's included) never get huge pages; an anonymous private
mapping advised with MADV_HUGEPAGE does. (docs/cpu_speed.md has the side-by-side figures.)

move_to_huge_pages copies each large storage of the network's parameters and buffers into one such
mapping and points every tensor that shared the old storage at the new one: the same bytes, so every
kernel gives the same results. Weights are moved one storage at a time and the old one is freed as soon
as nothing holds it, so loading peaks at the weights plus one storage, not twice the weights.
Where THP is off (`never`), missing, or the OS is not Linux, nothing moves.
"""
from __future__ import annotations

import mmap
import os

import torch

from sudu.host.memory import release_freed_memory

THP_DIR = "/sys/kernel/mm/transparent_hugepage"
MIN_BYTES = 64 << 10  # smaller storages (norms, biases) stay where they are: a few lines each, in cache
ALIGN = 4096
TRIM_BYTES = 64 << 20


def huge_page_size() -> int | None:
    """The PMD huge page size when transparent huge pages can be had through madvise, else None."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return None
    try:
        with open(os.path.join(THP_DIR, "enabled")) as f:
            if "[never]" in f.read():
                return None
        with open(os.path.join(THP_DIR, "hpage_pmd_size")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def huge_page_buffer(nbytes: int, page: int) -> torch.Tensor:
    """A uint8 tensor of nbytes starting on a `page` boundary, in a private anonymous mapping advised for
    huge pages. Its pages are committed as they are written; the tensor keeps the mapping alive."""
    m = mmap.mmap(-1, nbytes + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    start = (-whole.data_ptr()) % page
    return whole[start:start + nbytes]


def storage_holders(model: torch.nn.Module, min_bytes: int) -> dict[int, tuple[torch.UntypedStorage, list]]:
    """storage data_ptr -> (storage, [(module, kind, name, tensor, its view's geometry)]) for the CPU
    parameters and buffers whose storage holds at least min_bytes."""
    out: dict[int, tuple[torch.UntypedStorage, list]] = {}
    for module in model.modules():
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, t in table.items():
                if t is None or t.device.type != "cpu" or t.is_sparse or t.is_quantized:
                    continue
                s = t.untyped_storage()
                if s.nbytes() < min_bytes:
                    continue
                # the view's geometry now: a tensor held twice (a tied Parameter) is moved at its first holder
                view = (t.dtype, t.storage_offset(), t.size(), t.stride())
                out.setdefault(s.data_ptr(), (s, []))[1].append((module, kind, name, t, view))
    return out


def move_to_huge_pages(model: torch.nn.Module, min_bytes: int = MIN_BYTES) -> tuple[int, torch.Tensor | None]:
    """Move the network's large CPU storages into one huge-page mapping. Returns (bytes moved, the mapping's
    tensor, or None where nothing moved)."""

    page = huge_page_size()
    if page is None:
        return 0, None
    groups = storage_holders(model, min_bytes)
    if not groups:
        return 0, None
    offsets, total = {}, 0
    for ptr, group in groups.items():
        offsets[ptr] = total
        total += -(-group[0].nbytes() // ALIGN) * ALIGN
    del group  # no reference to a storage outlives its move
    arena = huge_page_buffer(total, page)
    freed = 0
    for ptr in list(groups):
        freed += _move(groups.pop(ptr), arena, offsets[ptr])
        if freed >= TRIM_BYTES:  # freed heap stays resident until trimmed: trim as we go, or loading peaks higher
            release_freed_memory()
            freed = 0
    release_freed_memory()
    return total, arena


def _move(group: tuple[torch.UntypedStorage, list], arena: torch.Tensor, base: int) -> int:
    """Copy one storage to arena[base:] and point its holders there; returns its size. Its last references
    go with this frame, so it is freed on return unless something outside the network holds it."""
    storage, holders = group
    nbytes = storage.nbytes()
    with torch.no_grad():
        arena[base:base + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,)))
        for module, kind, name, t, (dtype, offset, size, stride) in holders:
            start = (arena.storage_offset() + base) // dtype.itemsize + offset
            point_at(module, kind, name, torch.empty(0, dtype=dtype).set_(arena.untyped_storage(), start, size, stride))
    return nbytes


def point_at(module: torch.nn.Module, kind: str, name: str, tensor: torch.Tensor) -> None:
    """Make a module's parameter or buffer `name` hold `tensor`. A parameter keeps its Parameter object (its
    .data changes), so whatever shares that Parameter, a tied head say, sees the change too."""
    if kind == "parameter":
        module._parameters[name].data = tensor
    else:
        module._buffers[name] = tensor


def huge_page_bytes(buffer: torch.Tensor | None) -> int:
    """Bytes of the mapping holding `buffer` that the kernel backs with huge pages (/proc/self/smaps'
    AnonHugePages); 0 when unknown."""
    if buffer is None:
        return 0
    ptr = buffer.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(v, 16) for v in head.split("-"))
                    inside = lo <= ptr < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
