"""`--kv-cache-dtype auto`: the KV pool's format, chosen when the engine loads, by measurement.

On the CPU (float32 compute) auto picks, in order:
  * int8 (a quarter of float32's bytes; layers/kv_cache.py Int8KVCache) when it holds on a check text
    (CHECK_TEXT, apart from the scales' calibration text): over every position, the int8 pool's greedy
    token equals the float32 pool's at >= MIN_AGREEMENT of them, and the text's perplexity rises by at most
    MAX_PPL_RISE. These are the bars the native weights meet against the file (docs/cpu_speed.md): the
    default must not change what the model says. The reason line also gives the float16 pool's agreement
    on the same text: on a model with many near-ties float16 misses the bar too. The bar is not relative to
    float16's because a text this short cannot tell int8 from float16, which a long text does
    (docs/cpu_speed.md, "int8 KV: K around a centre");
  * else float16 (half the bytes, 10 mantissa bits) when every K and V value seen on both texts, times
    FLOAT16_HEADROOM, stays below float16's largest value;
  * else bfloat16 (float32's range, 7 mantissa bits).
Elsewhere (CUDA, a 16-bit compute dtype) auto is the compute dtype. An explicit --kv-cache-dtype is taken
as given.

Why measure rather than fix one format: int8's per-channel scales hold on some models and not on others
(docs/cpu_speed.md, "The KV pool's default format"), and float16's range is a property of the model's
activations. The check costs four forward passes over a few hundred tokens at load (its time per model:
the same section), once per weights: its result is kept in
$SUDU_HOME/kv_choice.json, keyed by the weights' content, their format and the check's bars and texts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field

import torch

from sudu.engine.kv_calibration import calibration_pass, int8_ranges, range_recorders, set_int8_ranges
from sudu.engine.text_eval import next_token_scores
from sudu.layers.kv_cache import (CALIBRATION_TEXT, KV_CACHE_DTYPES, KV_SCALE_MARGIN, Int8KVCache, KVCache,
                                  KVRangeRecorder, calibration_ids, network_ids)

log = logging.getLogger(__name__)

MIN_AGREEMENT = 0.99
MAX_PPL_RISE = 0.005
FLOAT16_HEADROOM = 16.0
FLOAT16_MAX = torch.finfo(torch.float16).max
LOGIT_ROWS = 64  # logits are computed this many positions at a time (a vocabulary-wide row is large)

CHECK_TEXT = (
    "User: My service times out under load. The handler reads a row, calls two other services and writes "
    "the result back. What should I look at first?\n"
    "Assistant: Start with where the time goes. Log the duration of each call with the request id, then "
    "compare the slow requests with the fast ones. Common causes are a connection pool that is too small, "
    "a retry loop without backoff, and a lock held across a network call.\n\n"
    "```go\nfunc (s *Server) Handle(ctx context.Context, id int64) error {\n"
    "\tctx, cancel := context.WithTimeout(ctx, 2*time.Second)\n\tdefer cancel()\n"
    "\trow, err := s.db.Get(ctx, id)\n\tif err != nil {\n\t\treturn fmt.Errorf(\"get %d: %w\", id, err)\n\t}\n"
    "\treturn s.db.Put(ctx, id, transform(row))\n}\n```\n\n"
    '{"region": "eu-west-1", "replicas": 3, "limits": {"cpu": "500m", "memory": "256Mi"}, '
    '"ports": [8080, 9090], "healthy": true}\n\n'
    "| year | revenue | growth |\n|------|---------|--------|\n| 2021 | 14.2 | 3.1% |\n| 2022 | 15.9 | 12.0% |\n"
    "| 2023 | 17.4 | 9.4% |\n\n"
    "缓存命中时，请求无需重新计算前缀，首个令牌的延迟因此大幅降低。\n"
    "Le cache évite de recalculer le préfixe commun des requêtes.\n\n"
    "The proof is by induction on n. For n = 1 the sum is 1 = 1(1 + 1)/2. Assume it holds for n; then "
    "1 + 2 + ... + n + (n + 1) = n(n + 1)/2 + (n + 1) = (n + 1)(n + 2)/2, which is the claim for n + 1."
)


@dataclass
class KVChoice:
    dtype: str  # a concrete KV_CACHE_DTYPES name
    reason: str  # one line for the log and /metrics' readers
    # int8's scales' source ranges per layer (k_max, v_max), when int8 was chosen: the runner sets its
    # pools' scales from them instead of repeating the calibration pass
    ranges: list[tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)
    figures: dict = field(default_factory=dict)


# the choices made in this process, by what decides them (a process that loads the same weights again, such
# as a test suite, does not repeat the check); and on disk, so a restarted server does not either
_MEMO: dict[tuple, KVChoice] = {}


def _stored_path():
    from sudu.paths import sudu_home

    return sudu_home() / "kv_choice.json"


def _stored(key: tuple) -> KVChoice | None:
    try:
        entry = json.loads(_stored_path().read_text()).get(_digest(key))
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("dtype") not in KV_CACHE_DTYPES[1:]:
        return None
    return KVChoice(entry["dtype"], str(entry.get("reason", "")) + " (measured at an earlier load)",
                    figures=dict(entry.get("figures", {})))


def _store(key: tuple, choice: KVChoice) -> None:
    """Adds the choice to the file (a failure to write only costs the next load the check)."""
    path = _stored_path()
    try:
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        table[_digest(key)] = {"dtype": choice.dtype, "reason": choice.reason, "figures": choice.figures}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep the KV format check's result in %s: %s", path, e)


def _digest(key: tuple) -> str:
    text = json.dumps([str(k) for k in key]) + CHECK_TEXT + CALIBRATION_TEXT
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def resolve(config, model: torch.nn.Module, tokenizer, device: torch.device, dtype: torch.dtype,
            ckpt=None, weight_format: str = "") -> tuple:
    """(config with a concrete kv_cache_dtype, the KVChoice behind it). ckpt, weight_format: the weights
    and their format, by whose content (cache/context.py model_identity) a check's result is reused;
    without ckpt the check runs anew."""
    reuse = ckpt is not None and config.kv_cache_dtype == "auto" and device.type == "cpu"
    choice = key = None
    if reuse:
        from sudu.cache.context import model_identity

        identity = f"{model_identity(config.model, ckpt.path)}/{weight_format}"
        key = (identity, device.type, str(dtype), MIN_AGREEMENT, "centred K", MAX_PPL_RISE,
               FLOAT16_HEADROOM, KV_SCALE_MARGIN)
        if config.rope_scaling:  # it changes the keys' values (YaRN scales cos/sin), so it is part of what decides
            key += (config.rope_scaling,)
        choice = _MEMO.get(key) or _stored(key)
    if choice is None:
        choice = choose(config.kv_cache_dtype, model, tokenizer, device, dtype)
        if reuse:
            _store(key, choice)
    if reuse:
        _MEMO[key] = choice
    if config.kv_cache_dtype == "auto":
        log.info("KV pool: %s (%s)", choice.dtype, choice.reason)
    return dataclasses.replace(config, kv_cache_dtype=choice.dtype), choice


def choose(requested: str, model: torch.nn.Module, tokenizer, device: torch.device, dtype: torch.dtype) -> KVChoice:
    if requested != "auto":
        return KVChoice(requested, "--kv-cache-dtype")
    name = str(dtype).removeprefix("torch.")
    if device.type != "cpu" or dtype != torch.float32:
        return KVChoice(name, "the compute dtype")
    if tokenizer is None:
        return KVChoice("float32", "no tokenizer to check a compressed pool with")
    cfg = model.config
    cal = calibration_ids(tokenizer, cfg)
    check = network_ids(tokenizer.encode(CHECK_TEXT, add_special_tokens=False), cfg)
    if len(cal) < 2 or len(check) < 2:
        return KVChoice("float32", "texts too short for the check")
    cal_pass = calibration_pass(model, cal)
    cal_ranges = int8_ranges(cal_pass)
    ref_logp, ref_top, check_ranges = _scores(model, check, range_recorders(cfg, len(check)))
    heads, k_dim, v_dim = cfg.kv_cache_shape()
    int8_pools = [Int8KVCache(len(check), heads, k_dim, v_head_dim=v_dim) for _ in range(cfg.num_hidden_layers)]
    set_int8_ranges(int8_pools, cal_ranges)
    logp, top, _ = _scores(model, check, int8_pools)
    f16_pools = [KVCache(len(check), heads, k_dim, torch.float16, v_head_dim=v_dim)
                 for _ in range(cfg.num_hidden_layers)]
    _, f16_top, _ = _scores(model, check, f16_pools)
    agreement = (top == ref_top).float().mean().item()
    f16_agreement = (f16_top == ref_top).float().mean().item()
    rise = math.exp(ref_logp.mean().item() - logp.mean().item()) - 1.0  # ppl(int8) / ppl(float32) - 1
    figures = {"int8_agreement": agreement, "int8_ppl_rise": rise, "float16_agreement": f16_agreement,
               "check_tokens": len(check)}
    int8_line = (f"int8 on {len(check)} tokens: greedy agreement {agreement:.1%} (float16 {f16_agreement:.1%}), "
                 f"perplexity {rise:+.2%}")
    bars = f"{MIN_AGREEMENT:.0%} / {MAX_PPL_RISE:+.1%}"
    if agreement >= MIN_AGREEMENT and rise <= MAX_PPL_RISE:
        return KVChoice("int8", f"{int8_line}, within {bars}", cal_ranges, figures)
    peak = max(t.max().item() for pair in [(r.k_max, r.v_max) for r in cal_pass] + check_ranges for t in pair)
    figures["peak_kv_value"] = peak
    if peak * FLOAT16_HEADROOM < FLOAT16_MAX:
        return KVChoice("float16", f"{int8_line} misses {bars}; "
                                   f"largest K/V value {peak:.4g} fits float16 with {FLOAT16_HEADROOM:g}x headroom",
                        figures=figures)
    return KVChoice("bfloat16", f"{int8_line} misses {bars}; largest K/V value "
                                f"{peak:.4g} too close to float16's limit", figures=figures)


@torch.inference_mode()
def _scores(model: torch.nn.Module, token_ids: list[int], pools: list[KVCache]):
    """(log-probability of each next token [n-1], greedy token at each position [n-1], the pools' recorded
    ranges if they are recorders) of one pass over token_ids."""
    logp, top = next_token_scores(model, token_ids, pools, LOGIT_ROWS)
    return logp, top, [(p.k_max, p.v_max) for p in pools if isinstance(p, KVRangeRecorder)]
