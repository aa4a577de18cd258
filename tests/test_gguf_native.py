"""`--quantization native`: GGUF's own blocks in the native kernels (layers/gguf_native.py,
kernels/gguf_tiles.cpp). Every format on random blocks against gguf-py's reference dequantization:
dequantized weights bit for bit, products within float rounding of (reference weights) x (the kernel's
int8-rounded activations), a row's result independent of its batch and of the instruction set, and fused
layers of mixed formats equal to their parts."""
import numpy as np
import pytest
import torch

from sudu import kernels
from sudu.engine import network
from sudu.layers import fuse, gguf_native, linear
from sudu.weights.gguf import QuantizedTensor
from tests.helpers.native_blocks import BLOCKS, isas, on_isa, random_tensor, saturated_tensor

ext = kernels.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"no native kernels: {kernels.disabled_reason() or 'compile failed'}")

def reference_weight(qt: QuantizedTensor) -> torch.Tensor:
    """gguf-py's dequantization (independent of sudu's decoders), rows permuted as sudu's loader does."""
    import gguf.quants

    blocks = qt.blocks if qt.row_permutation is None else qt.blocks[qt.row_permutation]
    values = gguf.quants.dequantize(np.ascontiguousarray(blocks), gguf.GGMLQuantizationType[qt.ggml_type])
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(qt.shape))


def rounded_activations(x: torch.Tensor, ggml_type: str = "Q8_0") -> torch.Tensor:
    """x as the kernels quantize it for a format, x * (1 / s) rounded to even and clamped to +-127, times s:
    q8_0 (s = amax / 127 per 32 columns), or for the K-quants q8_K (D = amax / 127 per 256 columns, and per
    32 s = D * f / 8 with f = ceil(8 * the block's amax / amax) in 1..8)."""
    g = x.reshape(x.shape[0], -1, 32)
    bmax = g.abs().amax(dim=-1, keepdim=True)
    if ggml_type.endswith("_K"):
        amax = x.reshape(x.shape[0], -1, 1, 256).abs().amax(dim=-1, keepdim=True)
        f = torch.ceil(8.0 * bmax.reshape(amax.shape[0], -1, 8, 1) / amax).clamp(1, 8)
        f = torch.where(amax != 0, f, torch.full_like(f, 8.0))
        d = ((amax / 127.0) * (f * 0.125)).reshape(bmax.shape)
    else:
        d = bmax / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv).clamp(-127, 127) * d).reshape(x.shape)


@pytest.mark.parametrize("ggml_type", list(BLOCKS))
def test_each_format_matches_the_reference(ggml_type):
    n, k = 40, 512  # 40 rows: a padded last tile
    qt = random_tensor(ggml_type, n, k, permute=True)
    ref = reference_weight(qt)
    bias = torch.randn(n)
    layer = gguf_native.native_layer(qt, bias)
    assert torch.equal(layer.dequantized_weight(), ref)
    assert torch.equal(layer._slice_dequantized(16, 40), ref[16:40])
    assert layer.weight_bytes() <= qt.blocks.nbytes * 148 / 144 + 2 * 16 * k  # the file's bytes, and padding
    torch.manual_seed(1)
    x = torch.randn(64, k)
    want = rounded_activations(x, ggml_type).double() @ ref.double().T + bias.double()
    outputs = {}
    for isa in isas():
        with on_isa(isa):
            for m in (1, 2, 3, 5, 8, 9, 17, 64):
                y = layer(x[:m])
                err = (y.double() - want[:m]).abs().max() / want[:m].abs().max()
                assert err < 2e-5, (isa, m, float(err))
                # a row's result does not depend on the rows it shares the call with
                assert torch.equal(y, layer(x[:m].flip(0)).flip(0))
                outputs[(isa, m)] = y
        assert torch.equal(outputs[(isa, 64)][:9], outputs[(isa, 9)])
        assert torch.equal(outputs[(isa, 1)], outputs[(isa, 17)][:1])
    for isa in isas()[1:]:  # AVX2, VNNI and AMX tiles: the same integers and float operations
        assert torch.equal(outputs[("avx2", 64)], outputs[(isa, 64)]), isa


@pytest.mark.parametrize("ggml_type", list(BLOCKS))
def test_codes_assembled_once_per_tile_give_the_same_rows(ggml_type):
    """Prompt-sized calls on the VNNI path assemble each tile's codes once (unpack_min_rows: from how many
    rows): bit for bit the rows of assembling them per 8 rows, at every row-chunk size (13 = 8 + 5)."""
    if not ext.cpu_has_vnni():
        pytest.skip("the once-per-tile codes are the AVX-512 VNNI path's")
    qt = random_tensor(ggml_type, 40, 512, permute=True)
    layer = gguf_native.native_layer(qt, torch.randn(40))
    x = torch.randn(13, 512)
    with kernels.options(unpack_min_rows=1, bypass_min_rows=1):  # outputs past the caches, too
        once = layer(x)
    with kernels.options(unpack_min_rows=1 << 40, bypass_min_rows=1 << 40):
        per_chunk = layer(x)
    assert torch.equal(once, per_chunk)


@pytest.mark.parametrize("ggml_type", list(BLOCKS))
def test_the_largest_codes_against_the_largest_activations_do_not_overflow(ggml_type):
    """Every code and sub-block scale at its largest (all bits set) against activations that all round to
    +127 or -127: the AVX2 kernels sum maddubs' int16 pairs over several chunks before widening them, and
    these are the sums closest to int16's limit."""
    n, k = 32, 512
    qt = saturated_tensor(ggml_type, n, k)
    ref = reference_weight(qt)
    layer = gguf_native.native_layer(qt, None)
    x = torch.ones(4, k)
    x[1] = -1
    x[2, ::2] = -1  # mixed signs within a block
    x[3] = 0.5
    want = x.double() @ ref.double().T
    for isa in isas():
        with on_isa(isa):
            xx = x.repeat(3, 1)  # 12 rows: past the 8-row kernel calls, where VNNI assembles codes once per tile
            assert torch.equal(layer_rows(layer, xx, 1), layer_rows(layer, xx, 1 << 40))
            torch.testing.assert_close(layer_rows(layer, xx, 1)[:4], layer(x))
            for m in (1, 4):
                y = layer(x[:m])
                err = (y.double() - want[:m]).abs().max() / want[:m].abs().max()
                assert err < 2e-5, (isa, m, float(err))


def layer_rows(layer, x, unpack_rows: int):
    with kernels.options(unpack_min_rows=unpack_rows):
        return layer(x)


def test_fused_layers_of_mixed_formats_equal_their_parts():
    """q/k/v of three formats (and gate/up of one) fused into one segmented call: the same outputs, bit for
    bit, as the separate layers, at 1 and 7 rows, through the kernels and dequantized."""
    k = 512
    parts = [gguf_native.native_layer(random_tensor(t, n, k, seed=i), torch.randn(n) if i != 1 else None)
             for i, (t, n) in enumerate([("Q5_0", 64), ("Q4_K", 32), ("Q8_0", 32), ("Q6_K", 16)])]
    fused = fuse.fuse_linears(parts)
    assert fused is not None and fused.fmt == "native" and fused.out_features == 144
    assert [f for f, _ in gguf_native.segments(fused.qweight)] == [gguf_native.Q5_0, gguf_native.Q4_K,
                                                                    gguf_native.INT8, gguf_native.Q6_K]
    x = torch.randn(7, k)
    for m in (1, 7):
        assert torch.equal(fused(x[:m]), torch.cat([p(x[:m]) for p in parts], dim=1))
    assert torch.equal(fused.dequantized_weight(), torch.cat([p.dequantized_weight() for p in parts]))
    same = fuse.fuse_linears([parts[0], gguf_native.native_layer(random_tensor("Q5_0", 48, k, seed=9), None)])
    assert len(gguf_native.segments(same.qweight)) == 1  # one format: one segment


def test_bad_segmented_tensors_are_refused():
    layer = gguf_native.native_layer(random_tensor("Q5_0", 16, 64), None)
    broken = layer.qweight.clone()
    broken[8 * 3 + 8:8 * 3 + 16] = torch.from_numpy(np.array([1 << 40], dtype=np.int64).view(np.uint8))  # tiles
    with pytest.raises(RuntimeError, match="does not fit"):
        ext.qlinear(torch.randn(1, 64), broken, None)
    with pytest.raises(RuntimeError, match="does not match"):
        ext.qlinear(torch.randn(1, 96), layer.qweight, None)
    with pytest.raises(RuntimeError, match="do not match"):  # blocks of another width or type
        ext.repack_gguf(torch.zeros(16, 22 * 3, dtype=torch.uint8), gguf_native.Q4_K, 96)


def test_native_on_a_gguf_runs_the_files_blocks(tmp_path, caplog):
    """quantize_model(native) on a GGUF: each linear layer holds its tensor's own blocks (dequantized, the
    file's values exactly); float tensors become int8, and the log says so."""
    from sudu.engine.network import load_network
    from sudu.weights.gguf import dequantize
    from sudu.weights.loader import load_checkpoint
    from tests.helpers.gguf_files import write_tiny_gguf

    write_tiny_gguf(tmp_path / "m.gguf", "qwen2")
    write_tiny_gguf(tmp_path / "tied.gguf", "qwen2", tied=True)
    tied = load_checkpoint(str(tmp_path / "tied.gguf"), progress=False)
    tied_model = network.quantize_model(load_network(tied.config, tied.tensors(torch.float32), torch.float32), tied, "native")
    # the file stores the tied table once (Q8_0): the head runs those blocks and the lookup shares its tiles
    assert tied_model.model.embed_tokens.qweight is tied_model.lm_head.qweight
    assert torch.equal(tied_model.lm_head.dequantized_weight()[:259], dequantize(tied.quantized("model.embed_tokens.weight")))
    ckpt = load_checkpoint(str(tmp_path / "m.gguf"), progress=False)
    model = load_network(ckpt.config, ckpt.tensors(torch.float32), torch.float32)
    network.quantize_model(model, ckpt, "native")
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, linear.QuantizedLinear):
            qt = ckpt.quantized(f"{name}.weight")
            if qt is not None and qt.ggml_type in gguf_native.NATIVE_TYPES:
                assert torch.equal(module.dequantized_weight(), dequantize(qt)), name
                checked += 1
    assert checked == 2 * 5 + 1  # per layer v, o, gate, up, down; the head
    emb = model.model.embed_tokens
    assert isinstance(emb, gguf_native.QuantizedEmbedding)  # no float table kept
    ids = torch.tensor([3, 258, 0])
    assert torch.equal(emb(ids), dequantize(ckpt.quantized("model.embed_tokens.weight"))[ids])
    assert "q_proj (float)" in caplog.text  # the file's float q/k: int8, said


def test_auto_runs_a_quantized_gguf_natively_and_speculation_stays_lossless(tmp_path):
    """`auto` on a quantized GGUF is native; greedy output does not depend on the batch, and n-gram
    speculation (verification rows beside other rows) gives exactly plain decoding's tokens."""
    import random

    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams
    from tests.helpers.gguf_files import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    plain = LLM(str(path), progress=False, kv_cache_memory=8 << 20)
    assert plain.engine.quantization == "native"
    fmts = {m.fmt for m in plain.engine.runner.model.modules() if isinstance(m, linear.QuantizedLinear)}
    assert "native" in fmts
    g = random.Random(0)
    prompts = [[g.randrange(250) for _ in range(g.randrange(3, 9))] * 3 for _ in range(12)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    batched = [r.token_ids for r in plain.generate(prompts, params)]
    assert [plain.generate([p], params)[0].token_ids for p in prompts[:4]] == batched[:4]
    spec = LLM(str(path), progress=False, kv_cache_memory=8 << 20, speculative="ngram", speculative_max_batch=64)
    assert [r.token_ids for r in spec.generate(prompts, params)] == batched
    assert spec.engine.speculator.num_draft_tokens > 0


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"])
def test_embedding_rows_are_the_files_values(ggml_type):
    """QuantizedEmbedding looks rows up from the tiles: the reference dequantization's rows, bit for bit, in
    any order and with repeats; ids outside the table are refused."""
    qt = random_tensor(ggml_type, 40, 512, seed=4)
    ref = reference_weight(qt)
    emb = gguf_native.QuantizedEmbedding(gguf_native.native_layer(qt, None).qweight, 40, 512, torch.float32)
    ids = torch.tensor([[39, 0, 17], [17, 5, 16]])
    assert torch.equal(emb(ids), ref[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        emb(torch.tensor([48]))


def test_native_weights_are_not_dequantized_at_load_and_none_is_left_unwritten(tmp_path, monkeypatch):
    """The loader hands the weights native layers replace as untouched placeholders (no float
    dequantization); a placeholder that no native layer replaced would be garbage, so loading refuses."""
    from sudu.engine.llm import LLM
    from sudu.errors import SuduError
    from sudu.weights import gguf as gguf_weights
    from tests.helpers.gguf_files import write_tiny_gguf

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    dequantized = []
    real = gguf_weights.dequantize
    monkeypatch.setattr(gguf_weights, "dequantize", lambda qt: dequantized.append(qt.name) or real(qt))
    LLM(str(path), progress=False, kv_cache_memory=1 << 20)
    assert dequantized and not any(n.endswith(("v_proj.weight", "gate_proj.weight", "lm_head.weight",
                                               "embed_tokens.weight")) for n in dequantized)
    assert any(n.endswith("q_proj.weight") for n in dequantized)  # the file's float q: dequantized as before
    monkeypatch.setattr(network, "quantize_native", lambda model, ckpt: model)  # engine/network.py calls it
    with pytest.raises(SuduError, match="placeholder"):
        LLM(str(path), progress=False, kv_cache_memory=1 << 20)
