"""Quantized linear layers (sudu/layers/linear.py, sudu/kernels): outputs match the float32 product with
their own dequantized weights; batching never changes a row's result; the PyTorch fallback gives the
same answers; a quantized tiny model's logits stay close to the float model's.

Tolerances: the kernel and the reference multiply the very same float32 weights (and the same
int8-rounded activations, mirrored by `round_activations_q8`), so they differ only by summation order. With |x| ~ 1, |w| ~ 0.05 and K = 96..160 terms, float32 rounding of a dot product is
~K * 2^-24 * sum|x w| ~ 1e-6; 1e-4 absolute leaves a wide margin and still catches any wrong weight
(one wrong int8 step alone moves an output by ~1e-3).
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sudu import kernels
from sudu.engine.llm import LLM
from sudu.layers import fuse
from sudu.layers import linear as L
from sudu.quant import formats as QF
from sudu.sampling import SamplingParams
from tests.helpers.tiny_models import build_hf_model

ATOL = 1e-4


def make_layer(fmt, n=72, k=160, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 40:72] = 0.0  # an all-zero group must not divide by zero
    b = torch.randn(n, generator=g) if bias else None
    return w, b, L.QuantizedLinear.from_float(fmt, w, b)


def round_activations_q8(x):
    """The kernel's activation rounding, mirrored: int8 codes per block of 32, scale = max|x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def dequantized(layer):
    """The layer's weights through the reference dequantization of its row layout."""
    return QF.dequantize_torch(layer.fmt, *layer.row_layout())


def reference(layer, x):
    """float32 product with the layer's dequantized weights; through the native kernel the activations
    are first rounded to int8 blocks (quant_linear.cpp), so the reference rounds them the same way."""
    w = dequantized(layer)
    if layer._ext is not None and x.shape[0] < L.PREFILL_MIN_ROWS:
        x = round_activations_q8(x)
    elif layer._ext is not None and L.PREFILL_DTYPE != torch.float32:  # prefill GEMM in bfloat16
        y = F.linear(x.to(L.PREFILL_DTYPE), w.to(L.PREFILL_DTYPE)).float()
        return y if layer.bias is None else y + layer.bias
    return F.linear(x, w, layer.bias)


@pytest.mark.parametrize("fmt", QF.FORMATS)
def test_quantization_error_is_bounded_by_the_grid(fmt):
    w, _, layer = make_layer(fmt)
    deq = dequantized(layer)
    _, scales, _, group = layer.row_layout()
    step = scales.float().repeat_interleave(group, dim=1)
    # round-to-nearest: at most half a step, plus float16 rounding of the scale (and min) themselves
    assert ((deq - w).abs() <= 0.5 * step + 2e-3 * w.abs().amax()).all()
    assert (deq[3, 40:72] == 0).all() or fmt == "int4"
    padded = -(-w.shape[0] // 16) * 16 * w.shape[1]  # whole tiles of 16 rows (160 columns: 5 blocks, int8 pads a 6th)
    assert layer.weight_bytes() == pytest.approx(padded * (1.0625 * 6 / 5 if fmt == "int8" else 0.625))


@pytest.mark.parametrize("fmt", QF.FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 33, 100, 300])  # 300: the prefill GEMM path
# 96, 160, 192, 352: 3, 5, 6, 11 blocks (int4: groups of 4, a last pair, a last odd block); 352: the scale loop's tail
@pytest.mark.parametrize("k", [96, 160, 192, 352])
def test_output_matches_float_reference_of_dequantized_weights(fmt, rows, k):
    _, _, layer = make_layer(fmt, k=k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(layer(x), reference(layer, x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt", QF.FORMATS)
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 9])
def test_groups_wider_than_a_block_match_the_reference(fmt, group_size, rows):
    """Scales shared by 2 or 4 blocks (the kernels then expand them to one per block, a row at a time)."""
    g = torch.Generator().manual_seed(group_size)
    w = torch.randn(50, 384, generator=g) * 0.05
    layer = L.QuantizedLinear.from_float(fmt, w, torch.randn(50, generator=g), group_size=group_size)
    x = torch.randn(rows, 384, generator=g)
    torch.testing.assert_close(layer(x), reference(layer, x), atol=ATOL, rtol=0)


@pytest.mark.skipif(kernels.load() is None, reason=f"no native kernels: {kernels.disabled_reason() or 'compile failed'}")
@pytest.mark.parametrize("fmt", QF.FORMATS)
@pytest.mark.parametrize("k", [96, 128, 160, 192, 352])  # 3-11 blocks: every tail path of the kernels
def test_kernel_rows_do_not_depend_on_batch_size(fmt, k):
    """Every row goes through the same float operations whatever the row count, so a row's result is bit
    for bit the same alone, in any batch, and on either instruction set (AVX2 or AVX-512 VNNI)."""
    _, _, layer = make_layer(fmt, n=37, k=k)  # 37: not a multiple of the kernel's row chunks
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(1))
    full = layer(x)
    for m in range(1, 34):
        assert torch.equal(layer(x[:m]), full[:m]), m
    single = torch.cat([layer(x[i:i + 1]) for i in range(33)])
    assert torch.equal(single, full)
    native = kernels.load().isa()
    with kernels.options(vnni=False) as ext:
        assert ext.isa() == "avx2"
        assert torch.equal(layer(x), full)
        assert torch.equal(layer(x[5:6]), full[5:6])
    assert ext.isa() == native


def test_dequantized_slices_match_one_shot(monkeypatch):
    _, _, layer = make_layer("int4", n=50)
    monkeypatch.setattr(L, "PREFILL_MIN_ROWS", 64)  # the GEMM path, whichever this CPU prefers (prefill_path)
    x = torch.randn(69, 160)
    whole = layer(x)
    monkeypatch.setattr(L, "DEQUANT_SLICE_BYTES", 160 * 4 * 7)  # slices of one 16-row tile (the least), a short last one
    torch.testing.assert_close(layer(x), whole, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt", QF.FORMATS)
@pytest.mark.parametrize("n,group_size,k", [(16, 32, 192), (37, 64, 192), (37, 32, 160)])  # 160: 5 blocks, int8 pairs one with a zero block
def test_tiles_hold_the_row_layout_exactly(fmt, n, group_size, k):
    """pack (the kernel's 16-row tiles, per-32 scales) and unpack lose nothing; padding rows are zero."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
    q, s, *m = (QF.quantize_int4 if fmt == "int4" else QF.quantize_int8)(w, group_size)
    m = m[0] if m else None
    tiles = QF.pack(fmt, q, s, m, group_size)
    blocks = k // 32 if fmt == "int4" else -(-k // 64)  # int8: pairs of blocks
    assert tiles.shape == (-(-n // 16), blocks, QF.TILE_BLOCK_BYTES[fmt]) and tiles.dtype == torch.uint8
    q2, s2, m2 = QF.unpack(fmt, tiles, n, k)
    assert torch.equal(QF.dequantize_torch(fmt, q2, s2, m2, 32), QF.dequantize_torch(fmt, q, s, m, group_size))
    padding = QF.unpack(fmt, tiles, tiles.shape[0] * 16, k)
    assert all(not t[n:].any() for t in padding if t is not None)


@pytest.mark.parametrize("fmt", QF.FORMATS)
def test_fused_layers_compute_what_the_parts_do(fmt):
    """Whole tiles are concatenated as they are; a part ending mid-tile goes through the row layout."""
    gen = torch.Generator().manual_seed(3)
    parts = [L.QuantizedLinear.from_float(fmt, torch.randn(n, 96, generator=gen), torch.randn(n, generator=gen))
             for n in (32, 16, 37)]
    x = torch.randn(3, 96, generator=gen)
    for group in (parts[:2], parts):
        fused = fuse.fuse_linears(group)
        assert fused.out_features == sum(p.out_features for p in group)
        assert torch.equal(fused(x), torch.cat([p(x) for p in group], dim=1))
    assert torch.equal(fuse.fuse_linears(parts[:2]).qweight, torch.cat([parts[0].qweight, parts[1].qweight]))


def test_bfloat16_activations_come_back_in_bfloat16():
    _, _, layer = make_layer("int8")
    x = torch.randn(4, 160).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference(layer, x.float()), atol=2e-2, rtol=1e-2)


def test_fallback_without_extension_matches_the_float_reference():
    """SUDU_NO_EXT=1 in a fresh interpreter: no compile, the PyTorch path (float activations, no int8
    rounding), the float32 product with the same dequantized weights."""
    code = (
        "import torch; from sudu import kernels; from sudu.layers import linear as L; from sudu.quant import formats as QF\n"
        "assert kernels.load() is None\n"
        "torch.manual_seed(0); w = torch.randn(40, 64) * 0.05; x = torch.randn(5, 64)\n"
        "for fmt in QF.FORMATS:\n"
        "    layer = L.QuantizedLinear.from_float(fmt, w)\n"
        "    print(fmt, repr(layer(x).sum(dim=1).tolist()))\n"
    )
    env = dict(os.environ, SUDU_NO_EXT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    torch.manual_seed(0)
    w, x = torch.randn(40, 64) * 0.05, torch.randn(5, 64)
    for line, fmt in zip(out.stdout.splitlines(), QF.FORMATS):
        got = torch.tensor(eval(line.split(" ", 1)[1]))
        assert line.startswith(fmt)
        layer = L.QuantizedLinear.from_float(fmt, w)
        deq = dequantized(layer)
        torch.testing.assert_close(got, F.linear(x, deq).sum(dim=1), atol=ATOL, rtol=0)


def test_quantize_model_replaces_every_linear(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), progress=False, quantization="int4")
    model = llm.engine.runner.model
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, L.QuantizedLinear)


@pytest.mark.parametrize("fmt,tol", [("int8", 0.02), ("int4", 0.3)])
def test_quantized_tiny_model_logits_stay_close(tiny_model_dirs, fmt, tol):
    """Greedy tokens of a tiny random model hinge on near-ties, so compare log-probabilities instead: the
    quantized engine's chosen tokens, teacher-forced through the float32 transformers reference, must score
    within `tol` nats of what the engine reported and of the reference's own best token. int8's relative
    weight error is ~0.5%, int4's ~8% (measured on this model), hence the two tolerances."""
    hf = build_hf_model("qwen2", seed=0)
    llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, quantization=fmt)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 380, (n,), generator=g).tolist() for n in (4, 17, 30)]
    results = llm.generate(prompts, SamplingParams(max_tokens=8, logprobs=1, temperature=0.0, ignore_eos=True))
    for prompt, r in zip(prompts, results):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + r.token_ids])).logits[0].float(), -1)
        for i, lp in enumerate(r.outputs[0].logprobs):
            row = ref[len(prompt) - 1 + i]
            assert abs(lp.logprob - row[lp.token_id].item()) < tol
            assert row.max().item() - row[lp.token_id].item() < tol


def test_auto_format_quantizes_quantized_checkpoints_only(tiny_model_dirs):
    """--quantization auto: native (the file's own blocks) for a checkpoint whose linear weights come quantized (GGUF k-quants),
    float for a float checkpoint (safetensors)."""
    from types import SimpleNamespace

    from sudu.engine.network import AUTO_FORMAT, resolve_format
    from sudu.weights.loader import load_checkpoint

    float_ckpt = load_checkpoint(str(tiny_model_dirs["qwen2"]), progress=False)
    assert resolve_format("auto", float_ckpt) == "none"
    assert resolve_format("int8", float_ckpt) == "int8"
    names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    kinds = {"model.layers.0.self_attn.q_proj.weight": "Q4_K", "model.norm.weight": "F32"}
    gguf = SimpleNamespace(format="gguf", tensor_names=lambda: names,
                           quantized=lambda n: SimpleNamespace(ggml_type=kinds[n]))
    assert resolve_format("auto", gguf) == AUTO_FORMAT == "native"
    kinds["model.layers.0.self_attn.q_proj.weight"] = "F16"
    assert resolve_format("auto", gguf) == "none"


@pytest.mark.parametrize("fmt", QF.FORMATS)
def test_bfloat16_dequantization_rounds_like_pytorch(fmt):
    """The prefill path dequantizes straight to bfloat16 (kernel) or through float32 (fallback): the same
    round-to-nearest-even values either way."""
    _, _, layer = make_layer(fmt, n=50)
    assert torch.equal(layer.dequantized_weight(torch.bfloat16), layer.dequantized_weight().to(torch.bfloat16))


@pytest.mark.skipif(kernels.load() is None, reason=f"no native kernels: {kernels.disabled_reason() or 'compile failed'}")
def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load():
    """torch's build lock is a plain file; a process killed mid-build (e.g. `sudu serve` stopped while it
    compiles) leaves it behind, and torch then waits for it forever. A fresh interpreter must still load
    the (cached) extension, and clear the stale file."""
    stale = kernels.build_dir() / "lock"
    stale.touch()
    try:
        code = "from sudu import kernels; assert kernels.load() is not None"
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_mlp_bfloat16_chunks_give_the_float32_routes_values(monkeypatch):
    """A prompt chunk through a quantized GatedMLP with bfloat16 GEMMs keeps gate_up in bfloat16 into
    silu_mul and the down projection: bit for bit what the float32 route (gate_up -> float32 -> silu_mul
    -> bfloat16 at the down GEMM) gives."""
    from sudu.layers.mlp import GatedMLP

    if kernels.load() is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setattr(L, "PREFILL_DTYPE", torch.bfloat16)  # any CPU runs bf16 GEMMs, natively or not
    monkeypatch.setattr(L, "PREFILL_MIN_ROWS", 64)
    g = torch.Generator().manual_seed(5)
    mlp = GatedMLP(96, 160, "silu")
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name)
        setattr(mlp, name, L.QuantizedLinear.from_float("int4", torch.randn_like(lin.weight, generator=g) * 0.1))
    mlp.fuse_projections()
    assert mlp._bf16_chunks
    x = torch.randn(70, 96, generator=g)
    y = mlp(x)
    mlp._bf16_chunks = False
    assert y.dtype == torch.float32 and torch.equal(y, mlp(x))
    assert torch.equal(mlp(x[:8]), mlp.down_proj(kernels.load().silu_mul(mlp.gate_up_proj(x[:8]))))


def test_a_long_prompts_mlp_in_row_blocks_gives_the_same_rows(monkeypatch):
    """A prompt chunk's MLP in row blocks (mlp.BLOCK_BYTES: 183 rows as 64 + 64 + 55 here): bit for bit
    the rows of one call, and every block goes through the native route (fused gate_up with silu * up in the
    same call: qlinear_silu)."""
    from sudu.layers import mlp as mlp_module

    ext = kernels.load()
    if ext is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setattr(L, "PREFILL_MIN_ROWS", L.NEVER)
    g = torch.Generator().manual_seed(6)
    mlp = mlp_module.GatedMLP(96, 160, "silu")
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name)
        setattr(mlp, name, L.QuantizedLinear.from_float("int4", torch.randn_like(lin.weight, generator=g) * 0.1))
    mlp.fuse_projections()
    x = torch.randn(183, 96, generator=g)
    whole = mlp(x)
    calls = []
    real = ext.qlinear_silu
    monkeypatch.setattr(mlp.gate_up_proj._ext, "qlinear_silu", lambda v, *a: calls.append(v.shape[0]) or real(v, *a),
                        raising=False)
    monkeypatch.setattr(mlp_module, "BLOCK_BYTES", 4 * 160 * 64)  # 64 rows of the fused call's output
    assert torch.equal(mlp(x), whole)
    assert calls == [64, 64, 55]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_outputs_written_past_the_caches_are_the_same(fmt):
    """Prompt-sized calls write their outputs with non-temporal stores (VNNI, bypass_min_rows): the same
    values as ordinary stores, at every row-chunk size (77 = 9 x 8 + 5)."""
    ext = kernels.load()
    if ext is None or not ext.cpu_has_vnni():
        pytest.skip("the non-temporal outputs are the AVX-512 VNNI path's")
    layer = L.QuantizedLinear.from_float(fmt, torch.randn(48, 128) * 0.1, torch.randn(48))
    x = torch.randn(77, 128)
    with kernels.options(bypass_min_rows=1):
        bypassed = layer(x)
    with kernels.options(bypass_min_rows=1 << 40):
        cached = layer(x)
    assert torch.equal(bypassed, cached)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_contiguous_shares_compute_every_tile_once(threads):
    """qlinear's threads each stream a contiguous share of the tiles and take chunks from the back of the
    others' when done (contiguous_shares): every output equals the shared counter's, with more threads
    than cores (shares taken by other threads), calls of fewer tiles than threads, one row and 13."""
    ext = kernels.load()
    if ext is None:
        pytest.skip("the native extension is not available")
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fmt, n in (("int8", 16), ("int4", 48), ("int4", 16 * 37), ("int8", 16 * 101)):
            layer = L.QuantizedLinear.from_float(fmt, torch.randn(n, 128) * 0.1, torch.randn(n))
            for rows in (1, 13):
                x = torch.randn(rows, 128)
                with kernels.options(contiguous_shares=True):
                    shares = layer(x)
                with kernels.options(contiguous_shares=False):
                    assert torch.equal(shares, layer(x)), (fmt, n, rows)
                assert torch.allclose(shares, x @ layer.dequantized_weight().T + layer.bias, atol=0.05)
    finally:
        torch.set_num_threads(before_threads)


@pytest.mark.parametrize("flags,amx_granted,path", [
    ({"avx2", "avx512_vnni", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16", "amx_bf16", "amx_tile"}, True,
     (torch.bfloat16, 256)),  # a Xeon with AMX: oneDNN's tile GEMMs
    ({"avx2", "avx512_vnni", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16", "amx_bf16", "amx_tile"}, False,
     (torch.float32, L.NEVER)),  # AMX listed, not granted by the OS
    ({"avx2", "avx512_vnni", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16"}, False,
     (torch.float32, L.NEVER)),  # Zen 4: bf16 dot products, no tiles: the integer kernel at every row count
    ({"avx2", "fma", "f16c"}, False, (torch.float32, L.NEVER)),  # AVX2 only: the integer kernel is ahead too
])
def test_prompt_chunks_take_the_path_the_cpus_multiply_units_favour(monkeypatch, flags, amx_granted, path):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx_granted)
    assert L.prefill_path() == path


def test_kernel_options_are_checked_and_restored():
    ext = kernels.load()
    if ext is None:
        pytest.skip("the native extension is not available")
    before = ext.kernel_options()
    with pytest.raises(ValueError, match="no kernel option"):
        with kernels.options(threads=3):
            pass
    with pytest.raises(RuntimeError, match="positive"):
        with kernels.options(unpack_min_rows=0):
            pass
    with kernels.options(fused_silu=False, bypass_min_rows=5):
        now = ext.kernel_options()
        assert (now.fused_silu, now.bypass_min_rows, now.vnni) == (False, 5, before.vnni)
    after = ext.kernel_options()
    assert (after.fused_silu, after.bypass_min_rows, after.unpack_min_rows, after.contiguous_shares, after.vnni) == (
        before.fused_silu, before.bypass_min_rows, before.unpack_min_rows, before.contiguous_shares, before.vnni)
