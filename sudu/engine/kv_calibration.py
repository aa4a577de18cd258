"""The int8 KV pool's scales and K centres, from one calibration pass over float32 pools that record every
layer's K and V ranges (layers/kv_cache.py KVRangeRecorder, Int8KVCache).

K is centred per rotary pair where the model's rotation tables allow it (KVRangeRecorder.int8_range): the
pair's angle per position comes from the table the layer rotates with, read back from the table itself
(atan2 of its second row), so scaled and YaRN-extended tables count as they are."""
from __future__ import annotations

import torch

from sudu.engine.text_eval import forward_text
from sudu.errors import SuduError
from sudu.layers.kv_cache import KV_SCALE_MARGIN, Int8KVCache, KVRangeRecorder
from sudu.layers.rotary import RotaryEmbedding
from sudu.model_config import ModelConfig


def rotary_angles(model: torch.nn.Module) -> list[tuple[list[torch.Tensor], int] | None]:
    """Per layer, (per rotary span of K: its pairs' angle per position [width / 2], the positions the table
    has), or None where K's rotation is not one plain table over the whole head (latent attention,
    multimodal rotary, a network without the attribute): those layers' K is not centred."""
    cfg = model.config
    tables: list[RotaryEmbedding | None]
    if hasattr(model, "rotary_global"):  # Gemma 3: local tables on sliding layers, global ones elsewhere
        tables = [model.rotary_local if cfg.is_sliding(i) else model.rotary_global
                  for i in range(cfg.num_hidden_layers)]
    else:
        tables = [getattr(model, "rotary", None)] * cfg.num_hidden_layers
    spans = cfg.kv_rotary_spans()
    out = []
    for table in tables:
        plain = type(table) is RotaryEmbedding  # not multimodal rotary (a subclass), not absent
        whole_head = len(spans) == 1 and plain and table.cos.shape[1] == spans[0][1]
        if cfg.kv_lora_rank or not whole_head or table.cos.shape[0] < 2:
            out.append(None)
            continue
        half = spans[0][1] // 2
        theta = torch.atan2(table.sin[1, :half].float(), table.cos[1, :half].float()).cpu()
        out.append(([theta], table.cos.shape[0]))
    return out


def range_recorders(model_cfg: ModelConfig, num_slots: int, device: torch.device | str = "cpu",
                    angles: list | None = None) -> list[KVRangeRecorder]:
    """One float32 pool per layer that records its K and V ranges (layers/kv_cache.py KVRangeRecorder);
    angles: rotary_angles' list, for K's centres."""
    heads, k_dim, v_dim = model_cfg.kv_cache_shape()
    spans = model_cfg.kv_rotary_spans()
    angles = angles or [None] * model_cfg.num_hidden_layers
    return [KVRangeRecorder(num_slots, heads, k_dim, device, v_dim, spans, angles[i])
            for i in range(model_cfg.num_hidden_layers)]


@torch.inference_mode()
def calibration_pass(model: torch.nn.Module, token_ids: list[int], device: torch.device | str = "cpu"
                     ) -> list[KVRangeRecorder]:
    """The recorders of one forward pass of token_ids, one per layer."""
    if not token_ids:
        raise SuduError("int8 KV calibration needs at least one token")
    recorders = range_recorders(model.config, len(token_ids), device, rotary_angles(model))
    forward_text(model, token_ids, recorders)
    return recorders


def int8_ranges(recorders: list[KVRangeRecorder]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer, (K half-range, V half-range, K centre) with KV_SCALE_MARGIN's headroom: what the int8
    pools are set from."""
    return [r.int8_range(KV_SCALE_MARGIN) for r in recorders]


def set_int8_ranges(caches: list, ranges: list) -> None:
    """Sets the scales and K centres of the int8 pools among caches from int8_ranges' list."""
    for cache, (k_half, v_half, k_centre) in zip(caches, ranges):
        if isinstance(cache, Int8KVCache):
            cache.set_range(k_half, v_half, k_centre)


def calibrate_int8_kv(model: torch.nn.Module, caches: list, token_ids: list[int]) -> None:
    """Sets the int8 pools among caches from one calibration pass of token_ids."""
    set_int8_ranges(caches, int8_ranges(calibration_pass(model, token_ids, caches[0].k.device)))
