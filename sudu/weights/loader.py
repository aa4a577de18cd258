"""load_checkpoint: one call from a user's model argument (catalog name, .gguf file, Hugging Face-style
directory) to a `Checkpoint` holding the network's config, its tokenizer, and lazy access to weights
under Hugging Face names. The model code only ever sees this; where bytes come from stays here."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from sudu.model_config import ModelConfig
from sudu.tokenizer import Tokenizer
from sudu.weights import gguf as gguf_weights
from sudu.weights import safetensors as st_weights
from sudu.weights.catalog import byte_progress, resolve_model_path
from sudu.weights.gguf import QuantizedTensor
from sudu.weights.mmproj import attach_mmproj

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    format: str = "gguf"  # "gguf" or "safetensors"
    progress: bool = False
    preprocessor: dict | None = None  # preprocessor_config.json of a vision-language directory
    _reader: Any = field(default=None, repr=False)  # the parsed GGUFFile; its memory map backs the blocks
    mmproj_reader: Any = field(default=None, repr=False)  # a llama.cpp mmproj file's (weights/mmproj.py)
    _quantized: dict[str, QuantizedTensor] = field(default_factory=dict, repr=False)

    def tensor_names(self) -> list[str]:
        if self.format == "gguf":
            names = list(self._quantized)
        else:
            names = st_weights.tensor_names(self.path, self.config.architecture)
        return [n for n in names if not self._beyond_decoder(n)]

    def _beyond_decoder(self, name: str) -> bool:
        """Tensors of layers past the decoder stack: DeepSeek-V3's multi-token-prediction layers, which
        checkpoints store as model.layers.{num_hidden_layers + i} (GGUF: blk.{...}); the network has none."""
        m = _LAYER_INDEX.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_hidden_layers

    def tensors(self, dtype: torch.dtype = torch.float32, placeholders: frozenset[str] = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) one at a time, dequantized as they are reached, so peak memory is
        the model in `dtype` plus one float32 tensor. Names in `placeholders` come as uninitialised tensors
        of their shape (no page touched): weights the caller replaces from the file's blocks, which
        dequantizing would only waste time on."""
        return self._tensors(dtype, lambda name: not self._beyond_decoder(name), "loading", placeholders)

    def mtp_tensors(self, dtype: torch.dtype = torch.float32, index: int = 0) -> dict[str, torch.Tensor]:
        """The index-th multi-token-prediction layer's tensors, named as inside the layer (enorm.weight,
        self_attn.kv_a_proj_with_mqa.weight, shared_head.head.weight, ...); empty when there is none."""
        prefix = f"model.layers.{self.config.num_hidden_layers + index}."
        if index >= self.config.num_nextn_predict_layers:
            return {}
        return {name[len(prefix):]: t for name, t in self._tensors(dtype, lambda n: n.startswith(prefix), "loading MTP")}

    def _tensors(self, dtype: torch.dtype, keep, what: str, placeholders: frozenset[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        if self.format != "gguf":
            for name, tensor in st_weights.iter_tensors(self.path, dtype, self.config.architecture, keep):
                yield name, tensor
            return
        chosen = {name: qt for name, qt in self._quantized.items() if keep(name)}
        total = sum(int(qt.blocks.nbytes) for qt in chosen.values())
        kv_b_parts: dict[str, dict[str, torch.Tensor]] = {}  # MLA files: k_b and v_b wait for each other
        with byte_progress(self.progress, f"{what} {self.path.name}", total) as advance:
            for name, qt in chosen.items():
                if name in placeholders:
                    advance(int(qt.blocks.nbytes))
                    yield name, torch.empty(qt.shape, dtype=dtype)
                    continue
                tensor = gguf_weights.dequantize(qt).to(dtype)
                advance(int(qt.blocks.nbytes))
                if name.endswith(("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")):
                    prefix, part, _ = name.rsplit(".", 2)
                    parts = kv_b_parts.setdefault(prefix, {})
                    parts[part] = tensor
                    if len(parts) == 2:
                        del kv_b_parts[prefix]
                        yield f"{prefix}.kv_b_proj.weight", gguf_weights.merge_kv_b(parts["k_b_proj"], parts["v_b_proj"])
                    continue
                yield name, tensor

    def state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return dict(self.tensors(dtype))

    def release_pages(self) -> None:
        """Drop the resident pages of the file's memory map once the network is built (GGUFFile.release_pages)."""
        for reader in (self._reader, self.mmproj_reader):
            if reader is not None:
                reader.release_pages()

    def quantized(self, name: str) -> QuantizedTensor | None:
        """The original GGUF blocks behind a Hugging Face name; None for float tensors and safetensors."""
        qt = self._quantized.get(name)
        return None if qt is None or qt.is_float else qt


def load_checkpoint(name_or_path: str, pull: bool = True, progress: bool = True, mmproj: str | None = None
                    ) -> Checkpoint:
    """mmproj: a llama.cpp mmproj file holding the vision tower of a GGUF language model (weights/mmproj.py)."""
    path = resolve_model_path(name_or_path, pull=pull, progress=progress)
    if path.is_dir():
        config = st_weights.read_config(path)
        tokenizer = Tokenizer.from_dir(path)
        checkpoint = Checkpoint(path, config, tokenizer, format="safetensors", progress=progress,
                                preprocessor=st_weights.read_preprocessor(path))
    else:
        reader = gguf_weights.open_gguf(path)
        config = gguf_weights.config_from_gguf(reader)
        tokenizer = Tokenizer.from_gguf(reader)
        checkpoint = Checkpoint(path, config, tokenizer, format="gguf", progress=progress, _reader=reader,
                                _quantized=gguf_weights.quantized_tensors(reader, config))
    if mmproj is not None:
        attach_mmproj(checkpoint, mmproj)
    # One stop list for everyone: the tokenizer knows the turn terminators config.json / GGUF leave out.
    config.eos_token_id = list(dict.fromkeys(list(config.eos_token_id) + tokenizer.eos_token_ids))
    return checkpoint
