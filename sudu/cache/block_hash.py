"""Stable block identity: a full KV block is named by a 128-bit content hash of its parent's hash and its
token ids, so one id names a whole prefix. The chain is rooted in a namespace that names everything that
makes the KV bytes of a token differ: the weights, the weight format the engine runs, the compute dtype
and device kind, the KV dtype and its calibrated scales, the block size, the RoPE configuration and the
pool layout. The same prompt gets the same ids in any process on any machine running the same setup,
which is what lets the disk tier, and replicas sharing it, reuse blocks. A matching id is still checked
against the block's token ids before use, so a collision cannot serve the wrong tokens.

blake2b with a 16-byte digest: as fast as SHA-256 truncated at these input sizes (a block is 16-64 token
ids), standard library, and sized for the id directly (benchmarks/context_cache.py measures the cost).
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

HASH_BYTES = 16
# bump when the bytes a block holds change meaning (pool layout, the disk payload's layer order)
KV_LAYOUT_VERSION = 1
# bytes sampled from each weight file for a path's identity (fingerprint_path)
_SAMPLES, _SAMPLE_BYTES = 32, 1 << 16


def block_hash(parent: bytes, token_ids) -> bytes:
    """The id of a full block: parent's id (the namespace for the first block) and the block's token ids
    as little-endian uint32."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(token_ids)}I", *token_ids), digest_size=HASH_BYTES).digest()


# marks the start of an image's entry after a block's token ids (not a token id: vocabularies stay far below it)
IMAGE_MARK = 0xFFFFFFFF


def block_key(token_ids, b: int, block_size: int, images=()) -> tuple[int, ...]:
    """What block b of a prompt is named by: its token ids, then for every image whose placeholder tokens
    overlap the block (images: objects with .offset, .num_tokens and a 16-byte .content_hash) IMAGE_MARK, the
    image's first position and its content hash as four uint32. Two prompts with the same tokens and different
    images at the same place differ from the first block that holds any of the image's tokens."""
    start, end = b * block_size, (b + 1) * block_size
    key = tuple(token_ids[start:end])
    for image in images:
        if image.offset < end and image.offset + image.num_tokens > start:
            key += (IMAGE_MARK, image.offset, *struct.unpack("<4I", image.content_hash[:16]))
    return key


def prefix_hashes(namespace: bytes, token_ids, block_size: int, num_blocks: int) -> list[bytes]:
    """Ids of the first num_blocks full blocks of token_ids."""
    out, parent = [], namespace
    for b in range(num_blocks):
        parent = block_hash(parent, token_ids[b * block_size:(b + 1) * block_size])
        out.append(parent)
    return out


def fingerprint_path(path: Path) -> str:
    """A content identity for a weights file or directory that costs a few MiB of reads, not the whole file:
    each file's size plus evenly spaced samples of its bytes (different weights differ everywhere, so the
    samples tell two checkpoints apart even when their sizes match). A directory hashes its config.json
    and weight files in name order."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin") or p.name == "config.json")
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name if path.is_dir() else ''}:{size}:".encode())
        with open(f, "rb") as fh:
            if size <= _SAMPLES * _SAMPLE_BYTES:
                digest.update(fh.read())
                continue
            for i in range(_SAMPLES):
                fh.seek(i * (size - _SAMPLE_BYTES) // (_SAMPLES - 1))
                digest.update(fh.read(_SAMPLE_BYTES))
    return "fp:" + digest.hexdigest()


def make_namespace(parts: dict) -> bytes:
    """The root id from a description of everything that shapes the KV bytes (JSON-serialisable values;
    tensors as their bytes' hash, see tensor_digest)."""
    text = json.dumps({"kv_layout_version": KV_LAYOUT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=HASH_BYTES).digest()


def tensor_digest(tensor) -> str:
    """A stable hex digest of a tensor's values (the int8 KV scales)."""
    return hashlib.sha256(tensor.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()
