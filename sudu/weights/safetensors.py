"""Hugging Face-style model directories: config.json -> ModelConfig, and the tensors of one or more
(sharded) `*.safetensors` files, read lazily one tensor at a time through safetensors' memory map."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from sudu.errors import SuduError
from sudu.models.config import ModelConfig


def read_config(path: str | Path) -> ModelConfig:
    config_file = Path(path) / "config.json"
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SuduError(f"cannot read {config_file}: {exc}") from None
    try:
        return ModelConfig.from_hf_config(cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise SuduError(f"{config_file}: {exc}") from None


def shard_files(path: str | Path) -> list[Path]:
    """The safetensors files of a directory; an index file, when present, names them."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise SuduError(f"{path}: shards named in {index.name} are missing: {', '.join(missing)}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SuduError(f"{path} has no *.safetensors files")
    return files


def tensor_names(path: str | Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def iter_tensors(path: str | Path, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in file order, each converted to `dtype` as it is read (bounded peak memory)."""
    from safetensors import safe_open

    for file in shard_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)
        except SuduError:
            raise
        except Exception as exc:  # safetensors raises its own error type on a truncated header
            raise SuduError(f"{file} is not a readable safetensors file: {exc}") from None
