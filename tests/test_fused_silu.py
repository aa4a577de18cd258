"""silu(gate) * up inside the fused gate_up call (kernels qlinear_silu, layers/mlp.py GatedMLP): every value
exactly what the gate_up call followed by silu_mul gives, for sudu's int8/int4 tiles and GGUF's own
formats (mixed ones included), with and without bias, at decode and prompt row counts, on both instruction
sets; gate/up widths that are not whole tiles each keep the two-pass route."""
import pytest
import torch

from sudu import kernels
from sudu.layers import gguf_native
from sudu.layers import fuse
from sudu.layers import linear as L
from sudu.layers.mlp import GatedMLP
from tests.helpers.native_blocks import isas, on_isa, random_tensor

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"no native kernels: {kernels.disabled_reason() or 'compile failed'}")

# decode, speculation, the 8-row kernel's edge, prompt chunks below and above the once-per-tile unpacking
ROWS = (1, 3, 8, 9, 64, 70)


def gate_up(kind: str, inter: int, k: int, bias: bool):
    """A fused gate | up layer of `kind` (int8, int4, or GGUF types 'gate_type/up_type')."""
    g = torch.Generator().manual_seed(inter)
    b = [torch.randn(inter, generator=g) if bias else None for _ in range(2)]
    if kind in ("int8", "int4"):
        parts = [L.QuantizedLinear.from_float(kind, torch.randn(inter, k, generator=g) * 0.05, b[i]) for i in range(2)]
    else:
        parts = [gguf_native.native_layer(random_tensor(t, inter, k, seed=i), b[i]) for i, t in enumerate(kind.split("/"))]
    fused = fuse.fuse_linears(parts)
    assert fused is not None and fused.out_features == 2 * inter
    return fused


@pytest.mark.parametrize("kind,bias", [("int8", True), ("int4", False), ("Q5_0/Q5_0", False),
                                       ("Q4_K/Q6_K", True), ("Q5_K/Q8_0", False)])
def test_fused_silu_gives_silu_mul_of_gate_up_bit_for_bit(kind, bias):
    fused = gate_up(kind, 48, 512, bias)
    x = torch.randn(max(ROWS), 512)
    for isa in isas():
        with on_isa(isa):
            for m in ROWS:
                want = ext.silu_mul(ext.qlinear(x[:m], fused.qweight, fused.bias))
                got = ext.qlinear_silu(x[:m], fused.qweight, fused.bias)
                assert got.shape == (m, 48)
                assert torch.equal(got, want), (isa, m)
                assert torch.equal(got[:1], ext.qlinear_silu(x[:1], fused.qweight, fused.bias))  # batch-invariant


def test_the_switch_gives_the_same_values_and_odd_tile_counts_are_refused():
    fused = gate_up("Q5_0/Q5_0", 32, 256, False)
    x = torch.randn(5, 256)
    on = ext.qlinear_silu(x, fused.qweight, None)
    assert ext.kernel_options().fused_silu is True
    with kernels.options(fused_silu=False):
        assert torch.equal(ext.qlinear_silu(x, fused.qweight, None), on)
    odd = fuse.fuse_linears([gguf_native.native_layer(random_tensor("Q5_0", 16, 256, seed=s), None) for s in range(3)])
    with pytest.raises(RuntimeError, match="even number of tiles"):
        ext.qlinear_silu(x, odd.qweight, None)


@pytest.mark.parametrize("inter,fused_call", [(64, True), (40, False)])
def test_gated_mlp_takes_the_fused_call_only_for_whole_tiles(monkeypatch, inter, fused_call):
    """An intermediate width of whole tiles runs qlinear_silu; 40 (gate's last tile half padding) keeps
    gate_up then silu_mul (and a float down projection: 40 columns are not whole int8 blocks); both give the
    float reference's values within the kernels' rounding."""
    mlp = GatedMLP(256, inter, "silu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.05)
    x = torch.randn(6, 256)
    want = mlp(x)
    for name in ("gate_proj", "up_proj", "down_proj")[:3 if inter % 32 == 0 else 2]:
        setattr(mlp, name, L.QuantizedLinear.from_float("int8", getattr(mlp, name).weight))
    mlp.fuse_projections()
    calls = []
    real = ext.qlinear_silu
    monkeypatch.setattr(mlp.gate_up_proj._ext, "qlinear_silu", lambda *a: calls.append(1) or real(*a), raising=False)
    got = mlp(x)
    assert bool(calls) == fused_call
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.02)
