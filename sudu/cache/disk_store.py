"""The disk tier of the context cache: KV blocks as files, found by their stable ids, kept across restarts.

Layout: <root>/<namespace hex>/<first 2 hex of id>/<id hex>-<parent id hex>.kv. The parent's id in the
name lets the index rebuild the prefix tree at start from a directory listing alone (no file is read),
which is what eviction needs to drop leaves before the prefixes they hang from; a lookup walking a chain
knows both ids, so it also finds files another server wrote after this one started.

A file is a header (magic, version, namespace, id, parent id, token count, payload length, CRC-32 of the
token ids and payload), the block's token ids as uint32, then the payload (cache/block_io.py: the pools'
own bytes). A file that fails any check (truncated, flipped bits, another namespace, other tokens) is a
miss: it is deleted, counted, and logged once per process; its bytes never reach attention.

Writes are atomic (a temporary file in the same directory, then rename) and run on a writer thread fed by
a bounded queue: the engine copies a block's bytes out and moves on; when the writer falls behind, new
blocks are dropped (counted), never waited for. Size is bounded: past max_bytes the least recently used
file with no child on disk goes first, so whole prefixes stay usable. Last use is the file's mtime
(set on each hit, by the writer thread), so the order survives restarts. Several servers may share one
root: renames are atomic, a file deleted under a reader is a miss, and each server's index learns of the
others' files when a lookup reaches them.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from sudu.paths import sudu_home

log = logging.getLogger(__name__)

MAGIC = b"SUDUKV\r\n"
FILE_VERSION = 1
HEADER = struct.Struct("<8sI16s16s16sIQI")  # magic, version, namespace, id, parent, num tokens, payload len, crc32
SUFFIX = ".kv"
NAMESPACE_FILE = "namespace.json"
DEFAULT_MAX_BYTES = 10 << 30
DEFAULT_FREE_SHARE = 0.2  # auto size: at most this share of the free space
DEFAULT_QUEUE_BYTES = 256 << 20  # payload bytes waiting for the writer before new blocks are dropped


def default_dir() -> Path:
    return sudu_home() / "kvcache"


def auto_size(root: Path) -> int:
    """10 GiB or a fifth of the free space where the cache lives, whichever is smaller."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int(min(DEFAULT_MAX_BYTES, shutil.disk_usage(probe).free * DEFAULT_FREE_SHARE))


class DiskCacheUnavailable(Exception):
    """The directory cannot hold the cache (unwritable, full): the engine serves without the disk tier."""


@dataclass
class DiskStats:
    hits: int = 0  # blocks loaded
    misses: int = 0  # lookups that found no usable file
    bytes_read: int = 0
    read_s: float = 0.0
    blocks_written: int = 0
    bytes_written: int = 0
    write_s: float = 0.0
    writes_dropped: int = 0  # the writer was behind
    write_errors: int = 0
    evictions: int = 0
    corrupt_dropped: int = 0


@dataclass
class _Entry:
    namespace: str
    parent: str
    size: int


@dataclass
class _Write:
    hash: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    payload: object  # a uint8 tensor of the block's bytes, owned by the queue
    nbytes: int


def encode_block(namespace: bytes, block_hash: bytes, parent: bytes, token_ids, payload) -> list:
    """The file's parts (header, token ids, payload) for writelines."""
    ids = struct.pack(f"<{len(token_ids)}I", *token_ids)
    data = memoryview(payload).cast("B")
    crc = zlib.crc32(data, zlib.crc32(ids))
    return [HEADER.pack(MAGIC, FILE_VERSION, namespace, block_hash, parent, len(token_ids), data.nbytes, crc), ids, data]


def decode_block(blob: bytearray, namespace: bytes, block_hash: bytes, parent: bytes, token_ids,
                 payload_nbytes: int) -> tuple[memoryview | None, str]:
    """(payload, "") when the file is the block asked for and intact, else (None, why)."""
    if len(blob) < HEADER.size:
        return None, "truncated header"
    magic, version, ns, h, par, n, length, crc = HEADER.unpack_from(blob)
    if magic != MAGIC or version != FILE_VERSION:
        return None, "not a sudu KV block file of this version"
    if ns != namespace:
        return None, "another namespace"
    if h != block_hash or par != parent:
        return None, "another block's id"
    ids_end = HEADER.size + 4 * n
    if n != len(token_ids) or length != payload_nbytes or len(blob) != ids_end + length:
        return None, "wrong size (truncated?)"
    view = memoryview(blob)
    if zlib.crc32(view[ids_end:], zlib.crc32(view[HEADER.size:ids_end])) != crc:
        return None, "checksum mismatch"
    if struct.unpack_from(f"<{n}I", blob, HEADER.size) != tuple(token_ids):
        return None, "other token ids"
    return view[ids_end:], ""


class DiskKVStore:
    def __init__(self, root: Path, namespace: bytes, payload_nbytes: int, max_bytes: int,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, description: dict | None = None):
        self.root = Path(root)
        self.namespace = namespace
        self.ns_hex = namespace.hex()
        self.payload_nbytes = payload_nbytes
        self.max_bytes = max_bytes
        self.queue_bytes = queue_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # id hex -> entry, least recently used first
        self._children: dict[str, int] = {}  # id hex -> files on disk whose parent it is (present or not)
        self._total_bytes = 0
        self._queued_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._warned: set[str] = set()
        self._open(description or {})
        self._writer = threading.Thread(target=self._write_loop, name="sudu-kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- start ---------------------------------------------------------------------------------
    def _open(self, description: dict) -> None:
        ns_dir = self.root / self.ns_hex
        try:
            ns_dir.mkdir(parents=True, exist_ok=True)
            probe = ns_dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"\0" * 4096)
            probe.unlink()
            meta = ns_dir / NAMESPACE_FILE
            if description and not meta.exists():
                tmp = ns_dir / f".{NAMESPACE_FILE}.{os.getpid()}"
                tmp.write_text(json.dumps(description, indent=1, sort_keys=True, default=str))
                os.replace(tmp, meta)
        except OSError as e:
            raise DiskCacheUnavailable(f"{self.root}: {e.strerror or e}") from None
        if self.max_bytes <= 0:
            raise DiskCacheUnavailable(f"{self.root}: no space for a disk cache (size {self.max_bytes} bytes)")
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        """The index of every namespace's files under root (all count towards max_bytes), from names and
        stat alone, oldest use first; leftovers of writers that died mid-write are removed."""
        found = []
        for ns_dir in _subdirs(self.root):
            for sub in _subdirs(ns_dir):
                for entry in os.scandir(sub):
                    if entry.name.startswith(".tmp-"):
                        _remove_orphan_tmp(entry)
                        continue
                    parsed = _parse_name(entry.name)
                    if parsed is None:
                        continue
                    try:
                        st = entry.stat()
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, parsed[0], _Entry(ns_dir.name, parsed[1], st.st_size)))
        found.sort(key=lambda t: t[0])
        for _, h, e in found:
            self._add(h, e)
        if found:
            log.info("disk KV cache %s: %d blocks, %.1f MiB", self.root, len(found), self._total_bytes / 2**20)

    # ---- paths ----------------------------------------------------------------------------------
    def path(self, h_hex: str, parent_hex: str, ns_hex: str | None = None) -> Path:
        return self.root / (ns_hex or self.ns_hex) / h_hex[:2] / f"{h_hex}-{parent_hex}{SUFFIX}"

    # ---- lookups (engine thread) ---------------------------------------------------------------------
    def contains(self, block_hash: bytes, parent: bytes) -> bool:
        """Whether a file for this block is known or present (it may still fail its checks on load)."""
        h = block_hash.hex()
        with self._lock:
            e = self._index.get(h)
            if e is not None:
                return e.namespace == self.ns_hex
        try:
            size = self.path(h, parent.hex()).stat().st_size  # written by another server sharing the root
        except OSError:
            return False
        with self._lock:
            if h not in self._index:
                self._add(h, _Entry(self.ns_hex, parent.hex(), size))
        return True

    def load(self, block_hash: bytes, parent: bytes, token_ids) -> memoryview | None:
        """The block's payload, or None (missing or failing a check: then the file is gone)."""
        h, p = block_hash.hex(), parent.hex()
        path = self.path(h, p)
        start = time.perf_counter()
        try:
            with open(path, "rb") as f:
                blob = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(blob)
                del blob[n:]
        except OSError:
            self.stats.misses += 1
            self._forget(h)
            return None
        payload, why = decode_block(blob, self.namespace, block_hash, parent, token_ids, self.payload_nbytes)
        if payload is None:
            self._drop_corrupt(path, h, why)
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(blob)
        self.stats.read_s += time.perf_counter() - start
        return payload

    def touch(self, hashes_and_parents: list[tuple[bytes, bytes]]) -> None:
        """Mark blocks as just used (LRU), in memory now and on disk (mtime) through the writer."""
        with self._lock:
            for h, _ in hashes_and_parents:
                if h.hex() in self._index:
                    self._index.move_to_end(h.hex())
        self._queue.put(("touch", [(h.hex(), p.hex()) for h, p in hashes_and_parents]))

    def has(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash.hex() in self._index

    def block_ids(self) -> list[bytes]:
        """Ids of this namespace's blocks known to be on disk (what a replica reports to the router)."""
        with self._lock:
            return [bytes.fromhex(h) for h, e in self._index.items() if e.namespace == self.ns_hex]

    def put(self, block_hash: bytes, parent: bytes, token_ids, payload) -> bool:
        """Queue a block for writing (payload: a uint8 tensor that the store now owns). False: dropped,
        because the writer is behind or the block is already on disk."""
        nbytes = payload.numel()
        with self._lock:
            if block_hash.hex() in self._index:
                return False
            if self._queued_bytes + nbytes > self.queue_bytes:
                self.stats.writes_dropped += 1
                return False
            self._queued_bytes += nbytes
        self._queue.put(("write", _Write(block_hash, parent, tuple(token_ids), payload, nbytes)))
        return True

    # ---- the writer thread ---------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            kind, item = self._queue.get()
            try:
                if kind == "stop":
                    return
                if kind == "touch":
                    self._touch_files(item)
                elif kind == "write":
                    self._write(item)
            except Exception:  # the writer must outlive any one bad block
                log.exception("disk KV cache writer")
            finally:
                if kind == "write":
                    with self._lock:
                        self._queued_bytes -= item.nbytes
                self._queue.task_done()

    def _touch_files(self, items: list[tuple[str, str]]) -> None:
        now = time.time_ns()
        for i, (h, p) in enumerate(items):
            try:  # the chain's root gets the newest time: a prefix is never older than its extensions
                os.utime(self.path(h, p), ns=(now - i, now - i))
            except OSError:
                pass

    def _write(self, w: _Write) -> None:
        h, p = w.hash.hex(), w.parent.hex()
        path = self.path(h, p)
        start = time.perf_counter()
        if path.exists():  # another server wrote it
            with self._lock:
                if h not in self._index:
                    self._add(h, _Entry(self.ns_hex, p, path.stat().st_size))
            return
        parts = encode_block(self.namespace, w.hash, w.parent, w.token_ids, w.payload.numpy())
        size = sum(memoryview(x).nbytes for x in parts)
        tmp = path.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{h}"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.writelines(parts)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            self.stats.write_errors += 1
            if e.errno == errno.ENOSPC:  # the disk is fuller than the budget allowed for: shrink the budget
                with self._lock:
                    self.max_bytes = min(self.max_bytes, self._total_bytes)
                    self._evict()
            self._warn_once("write", f"disk KV cache: cannot write {path}: {e.strerror or e}")
            return
        with self._lock:
            self._add(h, _Entry(self.ns_hex, p, size))
            self._evict()
        self.stats.blocks_written += 1
        self.stats.bytes_written += size
        self.stats.write_s += time.perf_counter() - start

    # ---- index upkeep (callers hold the lock) ----------------------------------------------------------
    def _add(self, h: str, e: _Entry) -> None:
        self._index[h] = e
        self._total_bytes += e.size
        self._children[e.parent] = self._children.get(e.parent, 0) + 1

    def _remove(self, h: str) -> _Entry | None:
        e = self._index.pop(h, None)
        if e is not None:
            self._total_bytes -= e.size
            left = self._children.pop(e.parent) - 1
            if left:
                self._children[e.parent] = left
        return e

    def _evict(self) -> None:
        """Least recently used files with no child on disk go first, until the total fits."""
        while self._total_bytes > self.max_bytes and self._index:
            victim = next((h for h in self._index if h not in self._children), None)
            if victim is None:
                victim = next(iter(self._index))
            e = self._remove(victim)
            _unlink(self.path(victim, e.parent, e.namespace))
            self.stats.evictions += 1

    def _forget(self, h: str) -> None:
        with self._lock:
            self._remove(h)

    def _drop_corrupt(self, path: Path, h: str, why: str) -> None:
        self.stats.corrupt_dropped += 1
        self._forget(h)
        _unlink(path)
        self._warn_once("corrupt", f"disk KV cache: dropped {path} ({why}); later ones are counted in /metrics")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind in self._warned:
            log.debug(message)
        else:
            self._warned.add(kind)
            log.warning(message)

    # ---- life ---------------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until the writer has emptied its queue (tests, graceful shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._queue.put(("stop", None))
        self._writer.join(timeout=5)

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)


def _subdirs(path: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _parse_name(name: str) -> tuple[str, str] | None:
    if not name.endswith(SUFFIX):
        return None
    parts = name[:-len(SUFFIX)].split("-")
    if len(parts) != 2 or any(len(x) != 32 for x in parts):
        return None
    return parts[0], parts[1]


def _remove_orphan_tmp(entry: os.DirEntry) -> None:
    """A temporary file whose writer process is gone (killed mid-write) is removed."""
    try:
        pid = int(entry.name.split("-")[1])
        os.kill(pid, 0)
        if pid != os.getpid():
            return  # a live writer
    except ProcessLookupError:
        pass
    except (ValueError, IndexError, PermissionError):
        return
    _unlink(Path(entry.path))


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def scan(root: Path) -> list[dict]:
    """Per namespace under root: its description (namespace.json), files and bytes (`sudu cache info`)."""
    out = []
    for ns_dir in sorted(_subdirs(root)):
        files = nbytes = 0
        for sub in _subdirs(ns_dir):
            for entry in os.scandir(sub):
                if _parse_name(entry.name) is not None:
                    files += 1
                    try:
                        nbytes += entry.stat().st_size
                    except OSError:
                        pass
        try:
            description = json.loads((ns_dir / NAMESPACE_FILE).read_text())
        except (OSError, ValueError):
            description = {}
        out.append({"namespace": ns_dir.name, "blocks": files, "bytes": nbytes, "description": description})
    return out
