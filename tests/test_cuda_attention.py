"""The CUDA path's paged attention kernel and step (sudu/cuda/), on the CPU through Triton's interpreter (set
in conftest.py where torch sees no GPU), or on a GPU where there is one.

- The kernel against SDPA over keys gathered through the block tables: ragged batches mixing decodes,
  verification-sized runs and prefill chunks, GQA, sliding windows, ring tables with released blocks, int8 KV.
- A row's result does not depend on its neighbours (what lossless speculation on this path needs).
- The engine on the CUDA path's step (the dry run, SUDU_CUDA_PATH_ON_CPU=1: static buffers, padding rows in the
  scratch block) gives the CPU engine's greedy tokens.
"""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from sudu.cuda.paged_attention import PagedBatch, paged_attention  # noqa: E402
from sudu.layers.kv_cache import Int8KVCache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(q_lens, seq_lens, block_size, num_blocks, window=0, released=(), seed=0):
    """Random block tables over a shuffled pool; `released`: (sequence, block index) pairs marked -1."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    width = max(len(t) for t in tables)
    bt = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    for i, j in released:
        bt[i, j] = -1
    qs = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    return PagedBatch(bt.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), qs.to(DEVICE),
                      max(q_lens), block_size, window), tables


def reference(q, k_pool, v_pool, tables, q_lens, seq_lens, block_size, scale, window):
    """SDPA per sequence over its keys gathered through its table (float32)."""
    H, Hkv = q.shape[1], k_pool.shape[1]
    out, row = torch.empty(q.shape[0], H, v_pool.shape[2]), 0
    for t, ql, n in zip(tables, q_lens, seq_lens):
        pos = torch.arange(n)
        slots = torch.tensor(t)[pos // block_size] * block_size + pos % block_size
        k = k_pool[slots].float().repeat_interleave(H // Hkv, 1).transpose(0, 1)
        v = v_pool[slots].float().repeat_interleave(H // Hkv, 1).transpose(0, 1)
        q_pos, k_pos = torch.arange(n - ql, n)[:, None], pos[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= q_pos - k_pos < window
        o = F.scaled_dot_product_attention(q[row:row + ql].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[row:row + ql] = o.transpose(0, 1)
        row += ql
    return out


@pytest.mark.parametrize("heads,kv_heads,window,pool", [
    (4, 2, 0, "float32"), (6, 2, 5, "float32"), (4, 4, 0, "int8"), (8, 1, 7, "bfloat16"),
])
def test_paged_kernel_matches_sdpa_over_gathered_keys(heads, kv_heads, window, pool):
    bs, D = 4, 16
    q_lens, seq_lens = [1, 3, 12, 1], [6, 11, 20, 1]  # decodes, a verification run, a prefill chunk, a first token
    batch, tables = make_batch(q_lens, seq_lens, bs, 24, window)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(24 * bs, kv_heads, D, generator=g)
    v = torch.randn(24 * bs, kv_heads, D, generator=g)
    q = torch.randn(sum(q_lens), heads, D, generator=g)
    scales = (None, None)
    if pool == "int8":
        cache = Int8KVCache(24 * bs, kv_heads, D)
        cache.set_range(k.abs().amax(0), v.abs().amax(0))
        cache.write(torch.arange(24 * bs), k, v)
        k_pool, v_pool, scales = cache.k, cache.v, (cache.k_scale.to(DEVICE), cache.v_scale.to(DEVICE))
        k_ref, v_ref = cache.read(torch.arange(24 * bs), torch.float32)
    else:
        k_pool, v_pool = k.to(getattr(torch, pool)), v.to(getattr(torch, pool))
        k_ref, v_ref = k_pool.float(), v_pool.float()
    dtype = torch.float32 if pool != "bfloat16" else torch.bfloat16
    qd = q.to(dtype)
    out = torch.empty(q.shape, dtype=dtype, device=DEVICE)
    paged_attention(qd.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE), batch, 0.3, out, *scales)
    ref = reference(qd.float(), k_ref, v_ref, tables, q_lens, seq_lens, bs, 0.3, window)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)


def test_ring_table_with_released_blocks_reads_only_the_window():
    """A sliding layer's ring table marks blocks behind the window -1; the kernel must not read them (their
    pool rows hold another sequence's values: NaN here, which would poison the output)."""
    bs, D, window = 4, 16, 6
    q_lens, seq_lens = [1, 2], [19, 14]
    batch, tables = make_batch(q_lens, seq_lens, bs, 16, window, released=[(0, 0), (0, 1), (0, 2), (1, 0)])
    g = torch.Generator().manual_seed(2)
    k = torch.randn(16 * bs, 2, D, generator=g)
    v = torch.randn(16 * bs, 2, D, generator=g)
    for i, j in [(0, 0), (0, 1), (0, 2), (1, 0)]:
        b = tables[i][j]
        k[b * bs:(b + 1) * bs] = float("nan")
        v[b * bs:(b + 1) * bs] = float("nan")
    q = torch.randn(3, 4, D, generator=g)
    out = torch.empty_like(q, device=DEVICE)
    paged_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), batch, 0.25, out)
    ref = reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), tables, q_lens, seq_lens, bs, 0.25, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_a_rows_result_does_not_depend_on_its_neighbours():
    """A sequence's rows computed among other sequences (a prefill chunk among them, which takes the large tile)
    equal, bit for bit, the same rows computed alone. On a
    GPU also: the last token of a verification run equals the same token decoded alone (Triton's interpreter
    multiplies tiles with NumPy's BLAS, whose result for a row can depend on where the row sits in the tile, so
    that half needs the real kernel)."""
    bs, D = 4, 16
    g = torch.Generator().manual_seed(3)
    k = torch.randn(32 * bs, 2, D, generator=g).to(DEVICE)
    v = torch.randn(32 * bs, 2, D, generator=g).to(DEVICE)
    together, tables = make_batch([1, 5, 2, 12], [9, 17, 13, 20], bs, 32, seed=4)
    q = torch.randn(20, 4, D, generator=g).to(DEVICE)
    out = torch.empty_like(q)
    paged_attention(q, k, v, together, 0.25, out)

    def alone(rows, seq_len, q_len):
        batch = PagedBatch(together.block_tables[1:2], torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
                           torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE), q_len, bs)
        o = torch.empty_like(q[rows])
        paged_attention(q[rows].contiguous(), k, v, batch, 0.25, o)
        return o

    assert torch.equal(alone(slice(1, 6), 17, 5), out[1:6])
    if DEVICE == "cuda":
        assert torch.equal(alone(slice(5, 6), 17, 1)[0], out[5])


def _greedy(tiny_model_dirs, arch, monkeypatch, cuda_path, **kw):
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams
    from tests.helpers.greedy import prompts_of

    monkeypatch.setenv("SUDU_CUDA_PATH_ON_CPU", "1" if cuda_path else "0")
    llm = LLM(str(tiny_model_dirs[arch]), progress=False, device="cpu", dtype="float32", quantization="none",
              speculative="none", max_num_batched_tokens=16, **kw)
    assert (llm.engine.runner.cuda_step is not None) == cuda_path
    prompts = prompts_of([3, 21, 9], seed=5)  # the 21-token prompt takes two chunks, riding along with decodes
    out = [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return out, llm.engine.runner.cuda_step


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without a GPU")
@pytest.mark.parametrize("arch,kv", [("qwen2", "float32"), ("gemma3", "float32"), ("llama", "int8")])
def test_cuda_step_dry_run_gives_the_cpu_engines_tokens(tiny_model_dirs, monkeypatch, arch, kv):
    """gemma3 decodes past its window through the ring pool; three sequences decode padded to four rows."""
    want, _ = _greedy(tiny_model_dirs, arch, monkeypatch, False, kv_cache_dtype=kv)
    got, step = _greedy(tiny_model_dirs, arch, monkeypatch, True, kv_cache_dtype=kv)
    assert got == want
    assert step.replays > 0 and step.sizes[0] == 1
