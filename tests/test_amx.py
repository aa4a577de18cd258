"""AMX's int8 tiles in the quantized products (kernels/amx_tiles.cpp): every weight format gives, at every row
count, bit for bit the outputs of the AVX-512 VNNI kernels and of the AVX2 kernels (independent code: maddubs
and madd on 8-lane halves), and an engine's greedy tokens and logprobs are the same with the tiles on and
off. The option is refused where the CPU lacks AMX or the OS does not grant it; everything else here is
skipped there, with that reason."""
import numpy as np
import pytest
import torch

from sudu import kernels
from sudu.engine.llm import LLM
from sudu.layers import fuse, gguf_native
from sudu.layers import linear as L
from sudu.sampling import SamplingParams
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.native_blocks import BLOCKS, random_tensor, saturated_tensor
from tests.helpers.tiny_models import save_tiny_model

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"no native kernels: {kernels.disabled_reason() or 'compile failed'}")
GRANTED = ext is not None and ext.cpu_has_amx()
needs_amx = pytest.mark.skipif(not GRANTED, reason="this CPU lacks AMX int8 tiles, or the OS does not grant them: "
                                                   "the AMX path is not exercised here")

ROWS = [1, 7, 16, 17, 64, 300, 1024]


def paths(layer, x) -> dict[str, torch.Tensor]:
    """The layer's outputs for x on each kernel path: AMX tiles from 16 rows (the VNNI kernels for the rows
    past the last 16), the VNNI kernels alone, and AVX2."""
    with kernels.options(vnni=True, amx=True, amx_min_rows=16) as e:
        assert e.isa() == "amx"
        amx = layer(x)
    with kernels.options(vnni=True, amx=False) as e:
        assert e.isa() == "avx512vnni"
        vnni = layer(x)
    with kernels.options(vnni=False, amx=False) as e:
        assert e.isa() == "avx2"
        avx2 = layer(x)
    return {"amx": amx, "vnni": vnni, "avx2": avx2}


def assert_paths_agree(layer, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        x[0, :32] = 0.0  # an all-zero activation block
        out = paths(layer, x)
        assert torch.equal(out["amx"], out["vnni"]), m
        assert torch.equal(out["vnni"], out["avx2"]), m
        assert out["amx"].abs().sum() > 0


def test_the_option_follows_the_cpu():
    if GRANTED:
        assert ext.kernel_options().amx is True  # the default where granted
        assert ext.isa() == "amx"
        with pytest.raises(RuntimeError, match="at least 16"):
            with kernels.options(amx_min_rows=8):
                pass
    else:
        assert ext.kernel_options().amx is False
        with pytest.raises(RuntimeError, match="no AMX"):
            with kernels.options(amx=True):
                pass


@needs_amx
@pytest.mark.parametrize("fmt", ["int8", "int4"])
# 3, 5 and 11 blocks (int8: a last block paired with a zero one); 37 rows: a padded last tile
@pytest.mark.parametrize("k", [96, 160, 352])
def test_sudu_tiles_give_the_vnni_and_avx2_bits(fmt, k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(37, k, generator=g) * 0.05
    w[3, 32:64] = 0.0
    layer = L.QuantizedLinear.from_float(fmt, w, torch.randn(37, generator=g))
    assert_paths_agree(layer, k)


@needs_amx
@pytest.mark.parametrize("ggml_type", list(BLOCKS))
def test_gguf_tiles_give_the_vnni_and_avx2_bits(ggml_type):
    # 40 rows: a padded last tile; K-quants 3 super-blocks, the others 5 blocks (an odd batch)
    k = 768 if ggml_type.endswith("_K") else 160
    layer = gguf_native.native_layer(random_tensor(ggml_type, 40, k, permute=True), torch.randn(40))
    assert_paths_agree(layer, k)


@needs_amx
@pytest.mark.parametrize("ggml_type", list(BLOCKS))
def test_the_largest_codes_against_the_largest_activations(ggml_type):
    """Every code and sub-block scale at its largest against activations that all round to +-127: the int32
    sums furthest from zero."""
    n, k = 32, 512
    layer = gguf_native.native_layer(saturated_tensor(ggml_type, n, k), None)
    x = torch.ones(48, k)
    x[1::3] = -1
    x[2::3, ::2] = -1
    out = paths(layer, x)
    assert torch.equal(out["amx"], out["vnni"]) and torch.equal(out["vnni"], out["avx2"])


@needs_amx
def test_fused_gate_up_and_segmented_weights_give_the_same_bits():
    """qlinear_silu (silu(gate) * up in the call, a tile pair at a time for prompt rows) and a segmented
    tensor of mixed formats (a fused q/k/v) take the tiles too."""
    g = torch.Generator().manual_seed(3)
    gate_up = L.QuantizedLinear.from_float("int8", torch.randn(64, 160, generator=g) * 0.05, torch.randn(64, generator=g))
    x = torch.randn(300, 160, generator=g)
    silu = {}
    for name, opts in {"amx": dict(amx=True, amx_min_rows=16), "vnni": dict(amx=False),
                       "avx2": dict(vnni=False, amx=False)}.items():
        with kernels.options(**opts) as e:
            silu[name] = e.qlinear_silu(x, gate_up.qweight, gate_up.bias)
    assert torch.equal(silu["amx"], silu["vnni"]) and torch.equal(silu["vnni"], silu["avx2"])
    parts = [gguf_native.native_layer(random_tensor(t, 32, 512, seed=i), torch.randn(32))
             for i, t in enumerate(["Q5_0", "Q4_K", "Q8_0"])]
    fused = fuse.fuse_linears(parts)
    x = torch.randn(100, 512, generator=g)
    out = paths(fused, x)
    assert torch.equal(out["amx"], out["vnni"]) and torch.equal(out["vnni"], out["avx2"])
    assert torch.equal(out["amx"], torch.cat([p(x) for p in parts], dim=1))


@needs_amx
@pytest.mark.parametrize("model,fmt", [("qwen2", "int8"), ("qwen2", "int4"), ("qwen2-gguf", "auto")])
def test_engine_answers_are_the_same_with_tiles_on_and_off(tmp_path, model, fmt):
    """Greedy tokens and their logprobs of prompts long enough for the tiles (chunks of 16 to 200 rows, and
    the decode steps below them), with AMX on (from 16 rows) and off."""
    if model == "qwen2-gguf":
        path = tmp_path / "m.gguf"
        write_tiny_gguf(path, "qwen2")
    else:
        path = save_tiny_model(tmp_path / "m", model)
    llm = LLM(str(path), progress=False, quantization=fmt, speculative="none", enable_prefix_caching=False,
              num_threads=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (200, 17, 64, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def answers():
        out = llm.generate(prompts, params)
        return [(r.token_ids, [(t.logprob, t.top) for t in r.outputs[0].logprobs]) for r in out]

    with kernels.options(amx=True, amx_min_rows=16):
        on = answers()
    with kernels.options(amx=False):
        off = answers()
    assert on == off
