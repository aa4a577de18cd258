"""The native elementwise decoder steps (kernels/ops.cpp) against their PyTorch definitions."""
import pytest
import torch
import torch.nn.functional as F

from sudu import kernels
from sudu.layers.norm import RMSNorm
from sudu.layers.rotary import RotaryEmbedding, apply_rotary, rotate_heads_

pytestmark = pytest.mark.skipif(kernels.load() is None, reason=f"no native kernels: {kernels.disabled_reason() or 'compile failed'}")


def g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", [1, 3, 700])  # 700 x 100: split over threads
@pytest.mark.parametrize("n", [100, 896])  # 100: a tail after the 8-wide loop
def test_rms_norm_and_fused_residual_add(rows, n):
    ext = kernels.load()
    x, d, w = torch.randn(rows, n, generator=g(0)) * 3, torch.randn(rows, n, generator=g(1)), torch.randn(n, generator=g(2))
    torch.testing.assert_close(ext.rms_norm(x, w, 1e-6), F.rms_norm(x, (n,), w, 1e-6), rtol=1e-5, atol=1e-5)
    s, out = ext.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, x + d)
    torch.testing.assert_close(out, F.rms_norm(x + d, (n,), w, 1e-6), rtol=1e-5, atol=1e-5)
    # each row on its own: the same bits alone as in the batch
    assert torch.equal(ext.rms_norm(x[-1:], w, 1e-6), ext.rms_norm(x, w, 1e-6)[-1:])


@pytest.mark.parametrize("n", [1, 7, 100, 151936])  # widths below, at and off the 8-wide loop; a real vocabulary
def test_argmax_rows_matches_torch_argmax(n):
    """The sampler's greedy pick (layers/sampler.py argmax_rows) is torch.argmax's: the first among equal
    maxima, a NaN counts as largest, an all -inf row gives 0."""
    ext = kernels.load()
    x = torch.randn(6, n, generator=g(3))
    x[1, -1] = 100.0  # the maximum in the tail
    x[2] = x[2, 0]  # all equal: the first
    x[3] = float("-inf")
    if n > 4:
        x[4, 2] = x[4, n - 2] = 50.0  # two equal maxima
        x[5, 3] = x[5, n - 1] = float("nan")  # the first NaN
    assert torch.equal(ext.argmax_rows(x), x.argmax(-1))
    assert torch.equal(ext.argmax_rows(x[4:5].contiguous()), x[4:5].argmax(-1))


def test_rmsnorm_module_uses_one_path_for_forward_and_add_forward():
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g(3)))
    x, d = torch.randn(4, 64, generator=g(4)), torch.randn(4, 64, generator=g(5))
    s, out = norm.add_forward(x, d)
    assert torch.equal(out, norm(x + d))


@pytest.mark.parametrize("rows,inter", [(1, 4864), (2, 20), (300, 96)])
def test_silu_mul(rows, inter):
    gu = torch.randn(rows, 2 * inter, generator=g(6)) * 6
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.load().silu_mul(gu), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,inter", [(1, 4864), (300, 21)])  # 21: tails after the 8- and 16-wide loops
def test_silu_mul_bfloat16_is_the_float32_result_rounded(rows, inter):
    gu = (torch.randn(rows, 2 * inter, generator=g(7)) * 6).bfloat16()
    out = kernels.load().silu_mul(gu)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, kernels.load().silu_mul(gu.float()).bfloat16())


@pytest.mark.parametrize("head_dim", [64, 20])  # 20: half of 10, a tail after the 8-wide loop
def test_rotary_in_place_matches_apply_rotary(head_dim):
    rope = RotaryEmbedding(head_dim, 10000.0, 512)
    pos = torch.tensor([0, 7, 300, 511])
    cos, sin = rope.lookup(pos, torch.float32)
    base = torch.randn(4, 6, head_dim, generator=g(7))  # 4 q heads + 1 k head rotated, 1 v head untouched
    ref = apply_rotary(base[:, :5], cos, sin)
    out = rotate_heads_(base.clone(), 5, cos, sin)
    torch.testing.assert_close(out[:, :5], ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[:, 5:], base[:, 5:])
    # rows with a stride (the fused qkv projection's view) rotate the same
    wide = torch.randn(4, 9, head_dim, generator=g(8))
    wide[:, :6] = base
    rotate_heads_(wide[:, :6], 5, cos, sin)
    assert torch.equal(wide[:, :6], out)


@pytest.mark.parametrize("K,N", [(16, 32), (48, 24), (128, 512)])  # 24: a tail after the 16-wide columns
def test_head_matmul_rows_are_the_same_in_any_call(K, N):
    """Latent attention's per-head products (kernels/latent.cpp): torch.bmm's values within float32
    rounding, and each row's bits the same alone, in a call of 1 to 4 rows and in any block of a long call,
    through a strided view (the query's nope part)."""
    ext = kernels.load()
    T, H = 37, 3
    x = torch.randn(T, H, K + 8, generator=g(9))[..., :K]
    w = torch.randn(H, K, N, generator=g(10)) / K ** 0.5
    whole = ext.head_matmul(x, w)
    ref = torch.bmm(x.double().transpose(0, 1), w.double()).transpose(0, 1)
    torch.testing.assert_close(whole.double(), ref, rtol=1e-5, atol=1e-5)
    for t0, t1 in [(36, 37), (5, 7), (0, 3), (10, 14), (3, 37)]:
        assert torch.equal(ext.head_matmul(x[t0:t1], w), whole[t0:t1]), (t0, t1)


@pytest.mark.parametrize("arch,fmt,kv", [("qwen2", "int4", "float32"), ("qwen2", "int8", "bfloat16"), ("qwen2", "int4", "int8"),
                                         ("qwen2", "int4", "float16"),
                                         # routed experts: a dense layer among routed ones with a gated shared
                                         # expert (qwen2moe), top-2 of 4 with renormalised weights (mixtral)
                                         ("qwen2moe", "int8", "auto"), ("mixtral", "int4", "float32"),
                                         # sliding-window layers in their own ring pool, local and global RoPE
                                         ("gemma3", "int4", "int8"), ("gemma3", "int8", "float16")])
def test_native_decode_stack_matches_the_layers_bit_for_bit(tiny_model_dirs, tmp_path_factory, arch, fmt, kv):
    """kernels/decoder.cpp runs a decode step's whole decoder stack in one call; every row must come out
    exactly as through models/llama.py's layers (same ops, same order), and steps it does not cover (prompt
    chunks) must keep taking the layers."""
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams
    from tests.helpers.tiny_models import save_tiny_model

    path = tiny_model_dirs.get(arch) or save_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch, seed=4)
    # no prefix cache: the second run must compute every prompt in the same steps as the first (cached KV
    # from a step of another composition differs in the last bits: prompt rows attend through SDPA)
    llm = LLM(str(path), progress=False, quantization=fmt, enable_prefix_caching=False, kv_cache_dtype=kv)
    model = llm.engine.runner.model
    if kv == "int8":  # K stored around a centre: the stack's write must subtract it as Int8KVCache.write does
        gen = torch.Generator().manual_seed(3)
        for c in llm.engine.runner.kv_caches:
            c.k_centre = torch.randn(c.k_scale.shape, generator=gen) * c.k_scale * 20
    assert model._native_decode is not None
    fn, *rest = model._native_decode
    if arch != "gemma3":
        assert any(rest[1]) == (arch != "qwen2")  # layers with experts
    calls = []
    model._native_decode = (lambda *a: calls.append(a[0].shape[0]) or fn(*a), *rest)
    # six prompts of different lengths (decode steps of 6 rows), then one alone (steps of one row); gemma's
    # tiny window is 8, so the longer ones decode past it
    prompts = [[5, 9, 13, 21, 8] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    native = llm.generate(prompts, params) + llm.generate(prompts[2:3], params)
    assert calls and max(calls) <= 6 and 1 in calls  # decode steps went native; prompt steps did not
    model._native_decode = None
    layers = llm.generate(prompts, params) + llm.generate(prompts[2:3], params)
    for a, b in zip(native, layers):
        assert a.token_ids == b.token_ids
        assert [(lp.logprob, lp.top) for lp in a.outputs[0].logprobs] == [(lp.logprob, lp.top) for lp in b.outputs[0].logprobs]
