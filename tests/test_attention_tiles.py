"""Attention's bfloat16-tile arithmetic (kernels/attention_tiles.cpp) against an independent float64 reference
of what it computes, and its choice at load (engine/attention_choice.py). Its invariance (every row the same
whatever the call) is in tests/test_invariance.py with the float32 arithmetic's."""
from __future__ import annotations

import pytest
import torch

from sudu import kernels
from sudu.engine import attention_choice
from sudu.errors import SuduError
from sudu.layers.kv_cache import make_kv_cache
from tests.helpers.native_blocks import bf16_tiles, needs_bf16_tiles

EXT = kernels.load()
TILES = bf16_tiles()


def reference(q, k, v, lo, hi, scale):
    """Row r of q [R, D] over keys [lo[r], hi[r]) of k, v [L, D]: softmax(q' k'^T) v' in float64, with q' =
    bfloat16(q * scale), k' = bfloat16(k), v' = bfloat16(v): the tiles' operands, summed without rounding."""
    qq = (q * scale).bfloat16().double()
    kk, vv = k.bfloat16().double(), v.bfloat16().double()
    j = torch.arange(k.shape[0])
    visible = (j[None] >= torch.tensor(lo)[:, None]) & (j[None] < torch.tensor(hi)[:, None])
    scores = (qq @ kk.T).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1) @ vv


@needs_bf16_tiles
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(32, 4, 4, 0), (64, 14, 2, 0), (96, 6, 2, 0),
                                                            (128, 8, 2, 50), (256, 4, 1, 0)])
def test_tiles_compute_bfloat16_attention(kind, head_dim, heads, kv_heads, window):
    """A 300-key prompt chunk of 77 queries over scattered slots: every output within the bfloat16 rounding of
    the weights (the one rounding the reference does not make) of the float64 reference."""
    g = torch.Generator().manual_seed(11)
    L, T = 300, 77
    cache = make_kv_cache(kind, 512, kv_heads, head_dim, torch.float32)
    if kind == "int8":
        cache.set_range(torch.full((kv_heads, head_dim), 6.0), torch.full((kv_heads, head_dim), 4.0))
    slots = torch.randperm(512, generator=g)[:L]
    cache.write(slots, 1.5 * torch.randn(L, kv_heads, head_dim, generator=g),
                torch.randn(L, kv_heads, head_dim, generator=g))
    k, v = cache.read(slots, torch.float32)  # the pool's values (int8: dequantized)
    q = torch.randn(T, heads, head_dim, generator=g)
    out = torch.empty_like(q)
    scales = (cache.k_scale, cache.v_scale) if kind == "int8" else (torch.empty(0), torch.empty(0))
    EXT.prompt_attention(q, cache.k, cache.v, *scales, slots, out, L - T, window, head_dim ** -0.5, True)
    group = heads // kv_heads
    for h in range(heads):
        hi = [L - T + i + 1 for i in range(T)]
        lo = [max(0, e - window) if window else 0 for e in hi]
        want = reference(q[:, h], k[:, h // group], v[:, h // group], lo, hi, head_dim ** -0.5)
        # int8: the query carries the K scales before its rounding, so its bfloat16 differs from q's
        tol = 2e-2 if kind == "int8" else 5e-3
        torch.testing.assert_close(out[:, h].double(), want, atol=tol, rtol=0)
    # a decode step of one of these rows (the narrow path: keys as the tiles' A operand) gives its bits
    for i in (0, 40, T - 1):
        hi = L - T + i + 1
        lo = max(0, hi - window) if window else 0
        mask = (torch.arange(L) >= lo) & (torch.arange(L) < hi)
        row = torch.empty(1, heads, head_dim)
        EXT.decode_attention(q[i:i + 1], cache.k, cache.v, *scales, torch.zeros(1, 1, dtype=torch.long),
                             slots[None], mask[None, None], head_dim ** -0.5, row, True)
        assert torch.equal(row[0], out[i]), i


@needs_bf16_tiles
def test_a_row_that_sees_no_key_is_zeros_and_scores_far_below_the_max_weigh_nothing():
    """Window 1 (each row sees only itself) and keys that make most weights underflow: no NaN, no garbage."""
    g = torch.Generator().manual_seed(2)
    L, D = 130, 64
    kc = torch.randn(L, 1, D, generator=g).half()
    kc[::7] *= 60  # a few keys dominate
    vc = torch.randn(L, 1, D, generator=g).half()
    q = torch.randn(L, 2, D, generator=g) * 4
    out = torch.empty_like(q)
    EXT.prompt_attention(q, kc, vc, torch.empty(0), torch.empty(0), torch.arange(L), out, 0, 1, D ** -0.5, True)
    torch.testing.assert_close(out, vc.float().expand(L, 2, D), atol=0.0, rtol=2 ** -8)  # its own value
    EXT.prompt_attention(q, kc, vc, torch.empty(0), torch.empty(0), torch.arange(L), out, 0, 0, D ** -0.5, True)
    assert torch.isfinite(out).all()


def test_tiles_refuse_what_they_cannot_take():
    if EXT is None:
        pytest.skip("the native kernels are not loaded")
    pool = torch.randn(40, 2, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        EXT.prompt_attention(torch.randn(4, 4, 16), pool, pool, torch.empty(0), torch.empty(0), torch.arange(40),
                             torch.empty(4, 4, 16), 36, 0, 0.25, True)


def test_the_choice_at_load():
    cpu = torch.device("cpu")
    assert attention_choice.resolve("float32", cpu, torch.float16, 64, 64) == "float32"
    # a float32 pool asks for float32 numbers; a head size the tiles cannot take falls back to float32
    assert attention_choice.resolve("auto", cpu, torch.float32, 64, 64) == "float32"
    assert attention_choice.resolve("auto", cpu, torch.float16, 16, 16) == "float32"
    assert attention_choice.resolve("auto", cpu, torch.float16, 64, 64) == ("bfloat16" if TILES else "float32")
    with pytest.raises(SuduError, match="multiple of 32"):
        attention_choice.resolve("bfloat16", cpu, torch.float16, 16, 16)
    if not TILES:
        with pytest.raises(SuduError, match="--attention-arithmetic bfloat16"):
            attention_choice.resolve("bfloat16", cpu, torch.float16, 64, 64)
    assert "cuda" in attention_choice.resolve("auto", torch.device("cuda"), torch.float16, 64, 64)


def test_bad_value_is_a_config_error():
    from sudu.config import EngineConfig

    with pytest.raises(ValueError, match="attention_arithmetic must be auto, float32 or bfloat16"):
        EngineConfig(attention_arithmetic="fp8").validate()
