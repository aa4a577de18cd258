"""The int8 KV pool's K centres (layers/kv_cache.py KVRangeRecorder.int8_range, engine/kv_calibration.py): the
bound holds at every position the rotary table has, centring tightens it where a bias holds a pair far from
zero, and attention over a centred pool is attention over the true keys."""
from __future__ import annotations

import math

import pytest
import torch

from sudu.layers.kv_cache import Int8KVCache, KVRangeRecorder
from sudu.layers.rotary import RotaryEmbedding, apply_rotary

HEADS, D, POSITIONS = 2, 64, 32768


def _keys(table: RotaryEmbedding, u: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u [T, HEADS, D] before rotation, turned to each position as the model's layers do."""
    cos, sin = table.lookup(positions, torch.float32)
    return apply_rotary(u, cos, sin)


def _pre_rotary(n: int, seed: int) -> torch.Tensor:
    """Small variation around a bias that puts the lowest-frequency pairs far from zero (Qwen2.5's K)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(HEADS, D)
    bias[:, D // 2 - 4:D // 2] = 150.0  # the slowest pairs' first channels
    bias[:, D - 4:] = -90.0  # and their second ones
    return bias + torch.rand(n, HEADS, D, generator=g) * 6 - 3


@pytest.fixture(scope="module")
def table():
    return RotaryEmbedding(D, 1e6, POSITIONS)


def _recorded(table: RotaryEmbedding, n: int = 300) -> KVRangeRecorder:
    half = D // 2
    theta = torch.atan2(table.sin[1, :half], table.cos[1, :half])
    rec = KVRangeRecorder(n, HEADS, D, rotary=([theta], POSITIONS))
    positions = torch.arange(n)
    rec.write(positions, _keys(table, _pre_rotary(n, 0), positions), torch.randn(n, HEADS, D))
    return rec


def test_the_bound_holds_at_every_position(table):
    """Keys drawn like the calibration's hold within centre +- half-range at any position of the table, far
    past the calibration's 300; so they never saturate at depth."""
    rec = _recorded(table)
    k_half, _, centre = rec.int8_range(2.0)
    assert centre.abs().sum() > 0
    positions = torch.randint(0, POSITIONS, (4000,), generator=torch.Generator().manual_seed(1))
    positions[:2] = torch.tensor([0, POSITIONS - 1])
    k = _keys(table, _pre_rotary(len(positions), 2), positions)
    assert ((k - centre).abs() <= k_half).all()


def test_centring_tightens_the_biased_pairs_only(table):
    """The slow pairs a bias holds far from zero get a half-range far below margin x their norm; pairs that
    turn through half a circle or more over the table keep the norm bound around zero."""
    rec = _recorded(table)
    k_half, _, centre = rec.int8_range(2.0)
    half = D // 2
    slow = list(range(half - 4, half))
    assert (k_half[:, slow] < rec.k_max[:, slow] * 2.0 / 4).all()
    theta = torch.atan2(table.sin[1, :half], table.cos[1, :half])
    fast = (theta * (POSITIONS - 1) >= math.pi).nonzero().flatten()
    assert len(fast) > 10
    assert (centre[:, fast] == 0).all() and (centre[:, fast + half] == 0).all()
    assert torch.equal(k_half[:, fast], rec.k_max[:, fast] * 2.0)


def test_pre_rotary_range_is_recovered(table):
    """The recorder undoes each position's rotation: a constant pre-RoPE vector records a zero-width range."""
    n = 200
    u = torch.randn(1, HEADS, D).expand(n, HEADS, D).contiguous()
    half = D // 2
    theta = torch.atan2(table.sin[1, :half], table.cos[1, :half])
    rec = KVRangeRecorder(n, HEADS, D, rotary=([theta], POSITIONS))
    rec.write(torch.arange(n), _keys(table, u, torch.arange(n)), torch.randn(n, HEADS, D))
    assert torch.allclose(rec.u_min, u[0], atol=1e-3) and torch.allclose(rec.u_max, u[0], atol=1e-3)


def test_attention_over_a_centred_pool_is_attention_over_its_keys():
    """The native kernels read K as stored (k - centre): q . centre is the same for every key of a query, so
    softmax drops it, and a decode row's output equals attention over the dequantized true keys."""
    from sudu import kernels
    from sudu.layers import attention as A

    if kernels.load() is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(5)
    n, heads = 40, 4
    cache = Int8KVCache(64, HEADS, D)
    centre = torch.randn(HEADS, D, generator=g) * 30
    cache.set_range(torch.full((HEADS, D), 4.0), torch.full((HEADS, D), 4.0), centre)
    k = centre + torch.randn(n + 1, HEADS, D, generator=g)
    v = torch.randn(n + 1, HEADS, D, generator=g)
    cache.write(torch.arange(n), k[:n], v[:n])
    q = torch.randn(1, heads, D, generator=g)
    meta = A.build_metadata([1], [torch.arange(n + 1)], [cache], None)
    assert meta.full.decode is not None  # the native decode kernel's path
    out = A.paged_attention(q, k[n:], v[n:], 0, meta, 1 / math.sqrt(D), sliding=False)
    kk, vv = cache.read(torch.arange(n + 1), torch.float64)
    assert (kk - k.double()).abs().max() < 4.0 / 127  # read() adds the centre back
    qq = q[0].double().view(HEADS, heads // HEADS, D)
    w = torch.softmax(torch.einsum("hgd,thd->hgt", qq, kk) / math.sqrt(D), -1)
    ref = torch.einsum("hgt,thd->hgd", w, vv).reshape(heads, D)
    assert torch.allclose(out[0].double(), ref, atol=1e-4)
