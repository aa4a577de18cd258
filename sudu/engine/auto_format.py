"""`--quantization auto` with an accuracy guard: the fast format only where it holds the model's quality.

auto runs int4 layers with an int8 output head (layers/linear.py AUTO_FORMAT, AUTO_HEAD_FORMAT) on
quantized checkpoints: on the default 0.5B that keeps 96.5% greedy agreement with float32 and +1.2%
perplexity. It is not safe on every model. On Gemma 3 270M (most of its bytes in a 262K-token embedding,
small layers) the same format raises perplexity by ~29% while int8 costs nothing measurable
(docs/cpu_speed.md). So before auto settles on int4 for a checkpoint, it runs the built-in calibration text
(layers/kv_cache.py CALIBRATION_*) through the float network and through the quantized one, every row through
the decode kernel as in decoding, and keeps int4 only if the perplexity of that text rises by at most
AUTO_MAX_PPL_RISE (the perplexity half of tests/test_quantization_accuracy.py's criterion). Otherwise it falls
back to int8 everywhere. The other half, greedy agreement, is measured there on the float model's own
completions, which would take a float decode per token at load; agreement at every position of a fixed text
is no stand-in (the 0.5B, +1.2% perplexity and 96.5% greedy agreement in the test, agrees at only 93.6% of
this text's positions: most of a text's positions are near-ties), so it is logged, not judged. Measured at
load: 0.5B -0.7%, 1.5B +0.2% (both keep int4), Gemma 3 270M +38% (falls back to int8).

The check costs two forward passes of ~270 tokens at the first load of a checkpoint (~2 s on the 0.5B);
the decision is cached in $SUDU_HOME/auto_format.json, keyed by the file (path, size, modification time)
and by the formats and criterion, so later loads skip it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Callable

import torch

from sudu.layers import linear
from sudu.layers.attention import build_metadata
from sudu.layers.kv_cache import KVCache, calibration_ids
from sudu.paths import sudu_home

log = logging.getLogger(__name__)

AUTO_MAX_PPL_RISE = 0.03
FALLBACK_FORMAT = "int8"
_CACHE_VERSION = "1"  # bump when the check or its text changes


@torch.inference_mode()
def forward_text(model: torch.nn.Module, token_ids: list[int], pools: list) -> torch.Tensor:
    """Final hidden states [n, hidden] of one sequence of token_ids, computed in one pass over the given
    per-layer KV pools (slots 0..n-1), sliding-window layers under their window mask."""
    cfg = model.config
    n = len(token_ids)
    window = cfg.sliding_window if "sliding_attention" in cfg.layer_types else None
    device = pools[0].k.device
    meta = build_metadata([n], [torch.arange(n)], pools, window)
    if device.type != "cpu":
        meta = meta.to(device)
    return model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), meta)


@torch.inference_mode()
def text_logits(model: torch.nn.Module, token_ids: list[int], pools: list | None = None,
                prefill_min_rows: int = 1 << 30) -> torch.Tensor:
    """float32 logits at every position, over the given per-layer KV pools (default: temporary float32
    ones). linear.PREFILL_MIN_ROWS is set to prefill_min_rows for the call: by default every row goes
    through the decode kernel, as decoding computes it. (tests/test_quantization_accuracy.py measures
    through this too.)"""
    cfg = model.config
    if pools is None:
        heads, k_dim, v_dim = cfg.kv_cache_shape()
        pools = [KVCache(len(token_ids), heads, k_dim, torch.float32, v_head_dim=v_dim)
                 for _ in range(cfg.num_hidden_layers)]
    saved, linear.PREFILL_MIN_ROWS = linear.PREFILL_MIN_ROWS, prefill_min_rows
    try:
        return model.compute_logits(forward_text(model, token_ids, pools)).float()
    finally:
        linear.PREFILL_MIN_ROWS = saved


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """Perplexity of token_ids[1:] under logits[:-1] (logits at every position of token_ids)."""
    target = torch.tensor(token_ids[1:]).unsqueeze(1)
    return math.exp(-torch.log_softmax(logits[:-1], dim=-1).gather(1, target).mean().item())


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, token_ids: list[int]) -> tuple[float, float]:
    """(perplexity rise of token_ids under logits over ref_logits, share of positions with the same argmax)."""
    agreement = (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
    return perplexity(logits, token_ids) / perplexity(ref_logits, token_ids) - 1, agreement


def _cache_path() -> Path:
    return sudu_home() / "auto_format.json"


def _cache_key(ckpt) -> str | None:
    try:
        st = os.stat(ckpt.path)
    except (OSError, TypeError):
        return None
    parts = [_CACHE_VERSION, str(Path(ckpt.path).resolve()), st.st_size, st.st_mtime_ns, linear.AUTO_FORMAT,
             linear.AUTO_HEAD_FORMAT, FALLBACK_FORMAT, AUTO_MAX_PPL_RISE]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _read_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache = _read_cache()
        cache[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only home only costs the check at the next load
        log.warning("could not cache the auto format decision in %s: %s", path, exc)


def quantize_auto(ckpt, model: torch.nn.Module, reload: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, str]:
    """The float network `model` quantized as `auto` decides (see the module docstring). reload() gives a
    fresh float network (the fallback needs one: quantization replaces layers in place). Returns (network,
    format name)."""
    def quantize(net: torch.nn.Module, fmt: str) -> tuple[torch.nn.Module, str]:
        head = {"lm_head": linear.AUTO_HEAD_FORMAT} if fmt == linear.AUTO_FORMAT else None
        return linear.quantize_model(net, ckpt, fmt, overrides=head), fmt

    key = _cache_key(ckpt)
    cached = _read_cache().get(key) if key else None
    if cached is not None and cached.get("format") in (linear.AUTO_FORMAT, FALLBACK_FORMAT):
        return quantize(model, cached["format"])
    ids = calibration_ids(ckpt.tokenizer, ckpt.config)
    if len(ids) < 2:  # nothing to measure with (a vocabulary without these texts' tokens): keep the format
        log.warning("auto: no calibration text for this tokenizer; %s unchecked", linear.AUTO_FORMAT)
        return quantize(model, linear.AUTO_FORMAT)
    log.info("auto: checking %s (%s head) against float on %d tokens (once per checkpoint)", linear.AUTO_FORMAT,
             linear.AUTO_HEAD_FORMAT, len(ids))
    ref = text_logits(model, ids)
    model, fmt = quantize(model, linear.AUTO_FORMAT)
    rise, agreement = compare(ref, text_logits(model, ids), ids)
    if rise > AUTO_MAX_PPL_RISE:
        log.warning("auto: %s would raise this model's perplexity by %.1f%% (argmax agreement %.1f%%); using %s",
                    linear.AUTO_FORMAT, 100 * rise, 100 * agreement, FALLBACK_FORMAT)
        model, fmt = quantize(reload(), FALLBACK_FORMAT)
    else:
        log.info("auto: %s holds (perplexity %+.2f%%, argmax agreement %.1f%%)", fmt, 100 * rise, 100 * agreement)
    if key:
        _write_cache(key, {"format": fmt, "ppl_rise": rise, "agreement": agreement, "path": str(ckpt.path)})
    return model, fmt
