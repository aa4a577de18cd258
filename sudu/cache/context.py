"""The engine's context cache, put together at load: its namespace (what the ids are rooted in) and its
disk tier (opened, or refused with one warning so the engine serves without it)."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

from sudu.cache.block_hash import fingerprint_path, make_namespace, tensor_digest
from sudu.cache.disk_store import DiskCacheUnavailable, DiskKVStore, auto_size, default_dir

log = logging.getLogger(__name__)


def model_identity(model: str, path: Path) -> str:
    """The catalog's SHA-256 for a catalog name, else a content fingerprint of the file or directory."""
    from sudu.weights.catalog import get_entry

    try:
        return "sha256:" + get_entry(model).sha256
    except Exception:  # not a catalog name: a path
        return fingerprint_path(path)


def engine_namespace(config, model_cfg, model_path: Path, weight_format: str, kv_caches: list,
                     dtype, device) -> tuple[bytes, dict]:
    """(namespace id, its description): everything that makes a token's KV bytes differ."""
    scales = [tensor_digest(c.k_scale) + tensor_digest(c.v_scale) + tensor_digest(c.k_centre) for c in kv_caches
              if getattr(c, "k_scale", None) is not None]
    description = {
        "model": config.model,
        "model_identity": model_identity(config.model, model_path),
        "weight_format": weight_format,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "kv_cache_dtype": config.kv_cache_dtype,
        "kv_scales": hashlib.sha256("".join(scales).encode()).hexdigest() if scales else None,
        "block_size": config.block_size,
        "model_config": dataclasses.asdict(model_cfg),  # RoPE (theta, scaling, local base), heads, layers
    }
    if config.mmproj:  # another vision tower gives an image's tokens other KV (only then: older ids stay valid)
        description["mmproj_identity"] = fingerprint_path(Path(config.mmproj))
    # the model argument names the file here, not its contents: two machines with the file at different paths
    # share blocks, so it stays out of the hash (it is kept for `sudu cache info`)
    return make_namespace({k: v for k, v in description.items() if k != "model"}), description


def disk_cache_bytes(config, root: Path) -> int:
    """The disk tier's size from config.disk_cache_size: 0 = off."""
    from sudu.config import _parse_bytes

    text = str(config.disk_cache_size).strip().lower()
    if text == "off":
        return 0
    if text == "auto":
        return auto_size(root)
    return _parse_bytes(text)


def open_disk_store(config, namespace: bytes, payload_nbytes: int, description: dict) -> DiskKVStore | None:
    """The disk tier, or None when it is off or cannot be used here (one warning; serving goes on)."""
    root = Path(config.disk_cache_dir).expanduser() if config.disk_cache_dir else default_dir()
    try:
        size = disk_cache_bytes(config, root)
        if size == 0:
            return None
        store = DiskKVStore(root, namespace, payload_nbytes, size, description=description)
    except (DiskCacheUnavailable, OSError) as e:
        log.warning("disk KV cache off: %s", e)
        return None
    log.info("disk KV cache: %s (namespace %s, up to %.1f GiB)", root, namespace.hex(), size / 2**30)
    return store
