"""Hugging Face-style model directories: config.json -> ModelConfig, and the tensors of one or more
(sharded) `*.safetensors` files, read lazily one tensor at a time through safetensors' memory map."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch

from sudu.errors import SuduError
from sudu.model_config import ModelConfig


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


def read_preprocessor(path: str | Path) -> dict | None:
    """preprocessor_config.json (a vision-language model's image preprocessing), or None when absent."""
    file = Path(path) / "preprocessor_config.json"
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SuduError(f"cannot read {file}: {exc}") from None


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


def tensor_names(path: str | Path, arch: str | None = None) -> list[str]:
    from safetensors import safe_open

    names = []
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            names.extend(canonical_name(n, arch) for n in f.keys())
    return names


# Mixtral's expert names -> the Qwen-MoE names sudu's MoE networks use (w1 = gate, w3 = up, w2 = down)
_MIXTRAL_NAMES = re.compile(r"\.block_sparse_moe\.(gate|experts\.\d+\.(w1|w2|w3))\.")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


# Qwen2.5-VL as transformers >= 5 saves it -> the names of the original checkpoints (and of sudu's network)
_VL_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
# Gemma 3's parts, as transformers >= 5 saves them and as the released checkpoints name them -> sudu's network
# (the released files nest the SigLIP tower's parts in vision_model, transformers >= 5 writes them without it)
_GEMMA3_VL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", "vision_tower."),
                       ("vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
                       ("model.multi_modal_projector.", "multi_modal_projector."))


def canonical_name(name: str, arch: str | None) -> str:
    """The name sudu's network gives a checkpoint tensor (the checkpoint's own, except Mixtral's experts and
    transformers >= 5's nesting of a vision-language model's parts)."""
    if arch in ("qwen2_5_vl", "gemma3_vl"):
        for prefix, canonical in _VL_PREFIXES if arch == "qwen2_5_vl" else _GEMMA3_VL_PREFIXES:
            if name.startswith(prefix):
                return canonical + name[len(prefix):]
        return name
    if arch != "mixtral":
        return name

    def rename(m: re.Match) -> str:
        part = m.group(1)
        if m.group(2):
            part = part[:-len(m.group(2))] + _MIXTRAL_EXPERT[m.group(2)]
        return f".mlp.{part}."

    return _MIXTRAL_NAMES.sub(rename, name)


def iter_tensors(path: str | Path, dtype: torch.dtype = torch.float32,
                 arch: str | None = None, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in file order, each converted to `dtype` as it is read (bounded peak memory); names as
    canonical_name gives them for architecture `arch`; keep(name) -> False skips a tensor unread."""
    from safetensors import safe_open

    for file in shard_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    canonical = canonical_name(name, arch)
                    if keep is None or keep(canonical):
                        yield canonical, f.get_tensor(name).to(dtype)
        except SuduError:
            raise
        except Exception as exc:  # safetensors raises its own error type on a truncated header
            raise SuduError(f"{file} is not a readable safetensors file: {exc}") from None
