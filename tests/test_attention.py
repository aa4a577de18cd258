"""The native attention kernel for few-new-token sequences (kernels/attention.cpp) against the PyTorch path
it replaces (index_select + SDPA), on random pools: GQA, sliding windows, padding, float32, float16, bfloat16 and int8 pools."""
from __future__ import annotations

import pytest
import torch

from sudu import kernels
from sudu.layers import attention as A
from sudu.layers.kv_cache import make_kv_cache

pytestmark = pytest.mark.skipif(kernels.load() is None, reason=f"no native kernels: {kernels.disabled_reason() or 'compile failed'}")


def scenario(kind: str, heads=6, kv_heads=2, head_dim=24, window=None, seed=0):
    """Four sequences with 1-NATIVE_MAX_Q new tokens over 1-70 cached ones, in a pool of 256 shuffled slots."""
    g = torch.Generator().manual_seed(seed)
    cache = make_kv_cache(kind, 256, kv_heads, head_dim, torch.float32)
    if kind == "int8":  # per-channel ranges from 0.5 to 4 (values past them saturate, on both paths alike)
        cache.set_range(0.5 + 3.5 * torch.rand(kv_heads, head_dim, generator=g),
                        0.5 + 3.5 * torch.rand(kv_heads, head_dim, generator=g))
    order = torch.randperm(256, generator=g)
    q_lens, ctx_slots, used = [1, A.NATIVE_MAX_Q, 3, 1], [], 0
    for q_len, ctx in zip(q_lens, [1, 70, 17, 40]):
        ctx_slots.append(order[used:used + ctx + q_len])
        used += ctx + q_len
    prior = torch.cat([s[:-q] for s, q in zip(ctx_slots, q_lens)])
    cache.write(prior, torch.randn(len(prior), kv_heads, head_dim, generator=g),
                torch.randn(len(prior), kv_heads, head_dim, generator=g))
    meta = A.build_metadata(q_lens, ctx_slots, [cache], window)
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, generator=g)
    k = torch.randn(T, kv_heads, head_dim, generator=g)
    v = torch.randn(T, kv_heads, head_dim, generator=g)
    return q, k, v, meta


def run(q, k, v, meta, native: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not native:
            m.setattr(A, "decode_kernel", lambda q, cache, max_q: None)
        return A.paged_attention(q, k, v, 0, meta, 0.3, sliding=meta.sliding is not None)


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("window", [None, 6])
def test_native_decode_matches_sdpa(kind, window, monkeypatch):
    q, k, v, meta = scenario(kind, window=window)
    assert meta.full.decode is not None and not meta.full.seqs  # every sequence takes the batched path
    expected = run(q, k, v, meta, False, monkeypatch)
    got = run(q, k, v, meta, True, monkeypatch)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_native_decode_reads_a_strided_query_of_a_fused_projection(monkeypatch):
    """The llama layer hands over q as a slice of the fused q/k projection output (rows not contiguous)."""
    q, k, v, meta = scenario("auto")
    qk = torch.cat([q, k], dim=1)
    strided = qk[:, :q.shape[1]]
    assert not strided.is_contiguous()
    torch.testing.assert_close(run(strided, k, v, meta, True, monkeypatch), run(q, k, v, meta, False, monkeypatch),
                               atol=2e-5, rtol=1e-4)


def test_a_row_does_not_depend_on_the_rest_of_the_batch(monkeypatch):
    """Bit for bit: a sequence's output is the same alone as among others, and a verification row is the
    same as the decode row at that position (what keeps greedy speculative decoding identical)."""
    q, k, v, meta = scenario("auto")
    together = run(q, k, v, meta, True, monkeypatch)
    n = A.NATIVE_MAX_Q  # sequence 1: n new tokens, rows 1..n
    seq1 = A.build_metadata([n], [meta_slots(meta, 1)], meta.kv_caches, None)
    alone = run(q[1:n + 1], k[1:n + 1], v[1:n + 1], seq1, True, monkeypatch)
    assert torch.equal(alone, together[1:n + 1])
    # its 3rd new token (row 3) as a one-token decode
    slots = meta_slots(meta, 1)
    third = A.build_metadata([1], [slots[:len(slots) - (n - 3)]], meta.kv_caches, None)
    assert torch.equal(run(q[3:4], k[3:4], v[3:4], third, True, monkeypatch), together[3:4])


def meta_slots(meta, b: int) -> torch.Tensor:
    """Sequence b's context slots, read back from the decode batch (its unpadded keys)."""
    d = meta.full.decode
    n = int(d.mask[b, 0].sum(-1).max())
    return d.slots[b, :n].clone()


def test_a_longer_sequence_in_the_step_does_not_move_the_others_off_the_kernel(monkeypatch):
    """A sequence with more new tokens than the kernel takes (a grammar's forced run, a short prompt chunk)
    attends on its own; the few-token sequences beside it keep the kernel, so their rows are bit for bit
    what they are without it (the guarantee speculative and constrained decoding build on)."""
    q, k, v, meta = scenario("float32")
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], k.shape[2]
    cache = meta.kv_caches[0]
    seqs = [meta_slots(meta, b) for b in range(4)]
    used = torch.cat(seqs)
    free = torch.tensor([s for s in range(256) if s not in set(used.tolist())])
    n_long = A.NATIVE_MAX_Q + 4
    long_slots = free[:n_long + 5]
    cache.write(long_slots[:5], torch.randn(5, kv_heads, head_dim, generator=g),
                torch.randn(5, kv_heads, head_dim, generator=g))
    q_lens = [1, A.NATIVE_MAX_Q, 3, 1]
    mixed = A.build_metadata(q_lens[:2] + [n_long] + q_lens[2:], seqs[:2] + [long_slots] + seqs[2:], [cache], None)
    assert mixed.full.decode.rows.shape[1] <= A.NATIVE_MAX_Q and len(mixed.full.seqs) == 1
    split = sum(q_lens[:2])
    ql = torch.randn(n_long, heads, head_dim, generator=g)
    kl = torch.randn(n_long, kv_heads, head_dim, generator=g)
    vl = torch.randn(n_long, kv_heads, head_dim, generator=g)
    cat = lambda a, b: torch.cat([a[:split], b, a[split:]])
    together = run(cat(q, ql), cat(k, kl), cat(v, vl), mixed, True, monkeypatch)
    alone = run(q, k, v, A.build_metadata(q_lens, seqs, [cache], None), True, monkeypatch)
    assert torch.equal(torch.cat([together[:split], together[split + n_long:]]), alone)


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_prompt_chunks_attend_in_the_metadatas_sdpa_dtype(kind):
    """A prompt chunk (from position 0, and a second chunk over cached keys under a mask) attended in
    bfloat16 (sdpa_dtype, the prefill GEMMs' dtype) stays within bfloat16 rounding of float32, comes back
    float32, and the decode rows of the same step do not move."""
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, d = 6, 2, 32
    cache = make_kv_cache(kind, 512, kv_heads, d, torch.float32)
    if kind == "int8":
        cache.set_range(torch.full((kv_heads, d), 4.0), torch.full((kv_heads, d), 4.0))
    q_lens, slots = [40, 30, 1], [torch.arange(0, 40), torch.arange(100, 160), torch.arange(300, 310)]
    prior = torch.cat([slots[1][:30], slots[2][:9]])
    cache.write(prior, torch.randn(len(prior), kv_heads, d, generator=g), torch.randn(len(prior), kv_heads, d, generator=g))
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    outs = {}
    for dtype in (None, torch.bfloat16):
        c = make_kv_cache(kind, 512, kv_heads, d, torch.float32)
        c.k.copy_(cache.k), c.v.copy_(cache.v)
        if kind == "int8":
            c.k_scale, c.v_scale = cache.k_scale, cache.v_scale
        meta = A.build_metadata(q_lens, slots, [c], None, sdpa_dtype=dtype)
        assert len(meta.full.seqs) == 2 and meta.full.seqs[1].mask is not None
        outs[dtype] = A.paged_attention(q, k, v, 0, meta, d ** -0.5, sliding=False)
    lowp, ref = outs[torch.bfloat16], outs[None]
    assert lowp.dtype == torch.float32
    assert not torch.equal(lowp[:70], ref[:70])  # it did run in bfloat16
    torch.testing.assert_close(lowp, ref, atol=3e-2, rtol=2e-2)
    assert torch.equal(lowp[70:], ref[70:])


def chunk_pool(kind: str, kv_heads: int, head_dim: int, g: torch.Generator):
    """A pool holding two sequences' cached keys: (cache, q_lens, slots) of a step with a first chunk from
    position 0 (149 tokens: item and key blocks with ragged ends), a later chunk of 70 over 90 cached keys, and
    one decode over 9."""
    cache = make_kv_cache(kind, 512, kv_heads, head_dim, torch.float32)
    if kind == "int8":
        cache.set_range(torch.full((kv_heads, head_dim), 4.0), torch.full((kv_heads, head_dim), 4.0))
    q_lens, slots = [149, 70, 1], [torch.arange(0, 149), torch.arange(200, 360), torch.arange(400, 410)]
    prior = torch.cat([slots[1][:90], slots[2][:9]])
    cache.write(prior, torch.randn(len(prior), kv_heads, head_dim, generator=g),
                torch.randn(len(prior), kv_heads, head_dim, generator=g))
    return cache, q_lens, slots


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window", [None, 23])
@pytest.mark.parametrize("head_dim", [24, 64])
def test_prompt_kernel_matches_sdpa(kind, window, head_dim, monkeypatch):
    """The native prompt-chunk kernel (kernels/attention.cpp prompt_attention) against SDPA on the same metadata
    (chunk_pool's step; the later chunk under a mask), grouped heads, sliding windows, a strided query; decode
    rows in the same step untouched."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads = 6, 2
    cache, q_lens, slots = chunk_pool(kind, kv_heads, head_dim, g)
    T = sum(q_lens)
    qk = torch.randn(T, heads + kv_heads, head_dim, generator=g)
    q, k = qk[:, :heads], qk[:, heads:]  # q strided, as the fused projection hands it over
    v = torch.randn(T, kv_heads, head_dim, generator=g)
    meta = A.build_metadata(q_lens, slots, [cache], window)
    view = meta.sliding if window else meta.full
    assert len(view.seqs) == 2 and view.seqs[1].mask is not None
    calls = []
    native = A.prompt_kernel(q, cache, torch.float32)
    assert native is not None
    monkeypatch.setattr(A, "prompt_kernel", lambda *a: lambda *b: calls.append(1) or native(*b))
    got = A.paged_attention(q, k, v, 0, meta, head_dim ** -0.5, sliding=window is not None)
    assert len(calls) == 2
    monkeypatch.setattr(A, "prompt_kernel", lambda *a: None)
    expected = A.paged_attention(q, k, v, 0, meta, head_dim ** -0.5, sliding=window is not None)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert torch.equal(got[T - 1:], expected[T - 1:])


def test_prompt_kernel_rejects_bad_shapes():
    ext = kernels.load()
    q, pool, out, none = torch.randn(10, 4, 16), torch.randn(12, 2, 16), torch.empty(10, 4, 16), torch.empty(0)
    with pytest.raises(RuntimeError, match="last of the keys"):
        ext.prompt_attention(q, pool, pool, none, none, torch.arange(12), out, 5, 0, 0.25, False)  # 5 + 10 > 12
    with pytest.raises(RuntimeError, match="multiple of 8"):
        pool12 = torch.randn(12, 2, 12)
        ext.prompt_attention(torch.randn(10, 4, 12), pool12, pool12, none, none, torch.arange(12),
                             torch.empty(10, 4, 12), 2, 0, 0.25, False)


@pytest.mark.skipif(kernels.load() is None or not kernels.load().cpu_has_avx512(),
                    reason="the wide attention path is AVX-512's")
@pytest.mark.parametrize("kind", ["float32", "float16", "int8"])
@pytest.mark.parametrize("head_dim", [24, 64, 80, 128])
def test_wide_attention_gives_the_avx2_bits(kind, head_dim, monkeypatch):
    """attention512 (kernels.h KernelOptions) computes the same fused multiply-add chains as the AVX2 path, a
    lane per key or per column: prompt chunks and decode rows bit for bit, at head sizes that fill 4, 3 or
    no 16-wide column groups (24: the values stay on AVX2, the scores do not)."""
    g = torch.Generator().manual_seed(head_dim)
    heads, kv_heads = 14, 2  # 7 query rows per kv head and position: row chunks of 8 and 6 with remainders
    cache, q_lens, slots = chunk_pool(kind, kv_heads, head_dim, g)
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, generator=g)
    k, v = torch.randn(T, kv_heads, head_dim, generator=g), torch.randn(T, kv_heads, head_dim, generator=g)
    meta = A.build_metadata(q_lens, slots, [cache], None)
    out = {}
    for wide in (False, True):
        with kernels.options(attention512=wide):
            out[wide] = A.paged_attention(q, k, v, 0, meta, head_dim ** -0.5, sliding=False)
    assert torch.equal(out[True], out[False])
    q, k, v, meta = scenario(kind, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=head_dim)
    for wide in (False, True):
        with kernels.options(attention512=wide):
            out[wide] = run(q, k, v, meta, True, monkeypatch)
    assert torch.equal(out[True], out[False])
