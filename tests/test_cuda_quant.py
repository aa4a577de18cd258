"""The CUDA path's weight-only int8 / int4 layers (sudu/cuda/quant_linear.py): the kernels compute the float
product with the row layout's reference dequantization (layers/linear.py dequantize_torch), a row's result
does not depend on the batch around it, quantize_model_cuda follows quantize_model's rules (Q8_0 blocks
copied exactly), fused layers compute what their parts do, and placement lets int8 / int4 (not native) run
on CUDA. Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1).

Tolerances: with float32 activations the kernel multiplies the very same float32 weights as the reference
(the same float32 products s * q (+ m)), in IEEE float32, so they differ only by summation order: with |x| ~ 1,
|w| ~ 0.05 and K <= 96 terms that is ~K * 2^-24 * sum|x w| ~ 1e-6, and 1e-5 still catches one wrong int8
step (~1e-3). 16-bit activations add the rounding of x, of the weights and of the output to that dtype, so the
reference rounds x and the weights the same way and the comparison allows the output's rounding (float16:
2^-11 relative; bfloat16: 2^-8).
"""
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from sudu.config import EngineConfig  # noqa: E402
from sudu.cuda import interpreted  # noqa: E402
from sudu.cuda import quant_linear as Q  # noqa: E402
from sudu.engine.placement import check_supported  # noqa: E402
from sudu.errors import SuduError  # noqa: E402
from sudu.engine.network import quantize_model_cuda  # noqa: E402
from sudu.layers import fuse  # noqa: E402
from sudu.quant import formats as QF  # noqa: E402
from tests.helpers.tiny_models import build_hf_model  # noqa: E402

DEVICE = "cpu" if interpreted() else "cuda"
ATOL = 1e-5


def make_layer(fmt, n, k, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    return Q.TritonQuantizedLinear.from_float(fmt, w, b).to(DEVICE)


def reference(layer, x, dtype=torch.float32):
    """float32 product of x and the reference dequantization, both first rounded to dtype as the kernel does."""
    w = QF.dequantize_torch(layer.fmt, *layer.row_layout()).to(dtype).float()
    y = x.to(dtype).float() @ w.T
    return y if layer.bias is None else y + layer.bias


@pytest.fixture
def row_independent_dot(monkeypatch):
    """On a GPU each tl.dot output element takes the same multiply-adds wherever its row sits in the tile. The
    interpreter's tl.dot is NumPy's float32 matmul, whose BLAS rounds some tile rows differently from others
    (rows 6..11 of 32 on this suite's machine), which no kernel can control: replace it by a product computed
    the same way for every element, so that what is tested is the kernel's part of batch invariance (tiles
    fixed in M, no split-K, masked rows that do not leak)."""
    if not interpreted():
        return
    import numpy as np
    from triton.runtime import interpreter

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        product = np.einsum("ik,kj->ij", a.data.astype(np.float32), b.data.astype(np.float32))
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)


@pytest.mark.parametrize("fmt", Q.FORMATS)
@pytest.mark.parametrize("n,k", [(40, 64), (96, 96)])  # N not a multiple of any tile; K: 2 and 3 groups of 32
@pytest.mark.parametrize("rows", [1, 3, 16, 33])  # 33: a second, masked tile of rows
@pytest.mark.parametrize("bias", [True, False])
def test_output_matches_the_reference_dequantization(fmt, n, k, rows, bias):
    layer = make_layer(fmt, n, k, bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    torch.testing.assert_close(y, reference(layer, x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt", Q.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_activations_come_back_in_their_dtype(fmt, dtype):
    if dtype == torch.bfloat16 and interpreted():
        # the interpreter stores bfloat16 as raw uint16 and its tl.dot multiplies those integers (Triton 3.x)
        pytest.skip("Triton's interpreter cannot multiply bfloat16; checked on a GPU (tests/test_device.py)")
    layer = make_layer(fmt, 40, 96)
    x = torch.randn(5, 3, 96, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y = layer(x.to(dtype))
    assert y.dtype == dtype and y.shape == (5, 3, 40)
    rel = 2 ** -11 if dtype == torch.float16 else 2 ** -8
    torch.testing.assert_close(y.float(), reference(layer, x, dtype), atol=1e-3, rtol=2 * rel)


def test_other_activation_dtypes_are_refused():
    layer = make_layer("int8", 40, 64)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        layer(torch.randn(2, 64, dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_a_row_computes_the_same_at_any_batch_size(fmt, row_independent_dot):
    layer = make_layer(fmt, 40, 96)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    full = layer(x)
    for i in (0, 6, 7, 31, 32, 39):  # both tiles of rows, and the rows NumPy's matmul rounds apart
        assert torch.equal(full[i:i + 1], layer(x[i:i + 1]))
    for lo, hi in ((5, 23), (30, 40), (0, 33)):
        assert torch.equal(full[lo:hi], layer(x[lo:hi]))
    assert torch.equal(full.reshape(2, 20, 40), layer(x.reshape(2, 20, 96)))


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_fused_layers_compute_what_the_parts_do(fmt, row_independent_dot):
    """Parts ending mid-tile (24 + 16 + 37 columns), one without a bias: each column exactly as before."""
    parts = [make_layer(fmt, n, 96, bias=n != 16, seed=n) for n in (24, 16, 37)]
    fused = fuse.fuse_linears(parts)
    assert isinstance(fused, Q.TritonQuantizedLinear) and fused.out_features == 77 and fused.in_features == 96
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))
    assert fuse.fuse_linears([parts[0], make_layer("int4" if fmt == "int8" else "int8", 16, 96)]) is None


@pytest.mark.parametrize("fmt,atol", [("int8", 1e-4), ("int4", 1e-4)])
def test_quantized_tiny_model_matches_its_dequantized_weights(fmt, atol):
    """The transformers tiny qwen2 with its linear layers swapped in place: logits as those of the same model
    whose weights are the reference dequantization of the same codes (only summation order differs; 2
    layers and the head compound it from ~1e-6 per product to well under 1e-4)."""
    quantized = build_hf_model("qwen2", seed=0)
    expected = build_hf_model("qwen2", seed=0)
    quantize_model_cuda(quantized, None, fmt)
    assert not any(type(m) is torch.nn.Linear for m in quantized.modules())
    with torch.no_grad():
        for name, module in expected.named_modules():
            if isinstance(module, torch.nn.Linear):
                layer = quantized.get_submodule(name)
                module.weight = torch.nn.Parameter(QF.dequantize_torch(fmt, *layer.row_layout()))
    ids = torch.randint(0, 380, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = quantized.to(DEVICE)(ids.to(DEVICE)).logits.float().cpu()
        want = expected(ids).logits.float()
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_q8_0_blocks_are_copied_not_requantized(tmp_path):
    """A GGUF checkpoint: Q8_0 tensors become int8 holding the file's values exactly; another type (Q4_0) is
    quantized from its loaded floats, as quantize_model does; int4 quantizes everything from floats."""
    from sudu.engine.network import load_network
    from sudu.weights.loader import load_checkpoint
    from tests.helpers.gguf_files import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    values = write_tiny_gguf(path, "qwen2")
    ckpt = load_checkpoint(str(path), progress=False)
    model = quantize_model_cuda(load_network(ckpt.config, ckpt.tensors(torch.float32), torch.float32), ckpt, "int8")
    v = model.get_submodule("model.layers.0.self_attn.v_proj")
    q, s = QF.q8_0_blocks(ckpt.quantized("model.layers.0.self_attn.v_proj.weight"))
    assert torch.equal(v.qweight, q) and torch.equal(v.scales, s)
    assert torch.equal(QF.dequantize_torch("int8", *v.row_layout()),
                       torch.from_numpy(values["model.layers.0.self_attn.v_proj.weight"]))
    assert torch.equal(v.bias, torch.from_numpy(values["model.layers.0.self_attn.v_proj.bias"]))
    o = model.get_submodule("model.layers.0.self_attn.o_proj")  # Q4_0 in the file
    requantized = QF.quantize_int8(torch.from_numpy(values["model.layers.0.self_attn.o_proj.weight"]))
    assert torch.equal(o.qweight, requantized[0]) and torch.equal(o.scales, requantized[1])
    model4 = quantize_model_cuda(load_network(ckpt.config, ckpt.tensors(torch.float32), torch.float32), ckpt, "int4")
    v4 = model4.get_submodule("model.layers.0.self_attn.v_proj")
    assert v4.fmt == "int4" and torch.equal(v4.qweight, QF.quantize_int4(torch.from_numpy(
        values["model.layers.0.self_attn.v_proj.weight"]))[0])


def test_placement_runs_int8_and_int4_on_cuda_and_refuses_native(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for fmt in ("int8", "int4", "none", "auto"):
        check_supported(EngineConfig(device="cuda", quantization=fmt))
    with pytest.raises(SuduError, match="native runs on sudu's CPU kernels only.*int8, int4 or none"):
        check_supported(EngineConfig(device="cuda", quantization="native"))


def test_sudu_imports_without_triton():
    """Triton is needed to run the kernels only: the layers, their wiring and placement import without it."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import sudu, sudu.engine.model_runner, sudu.engine.placement, sudu.cuda.quant_linear\n")
    subprocess.run([sys.executable, "-c", code], check=True)
