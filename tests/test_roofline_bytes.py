"""`sudu roofline`'s bytes per decode token against the checkpoint's tensor sizes, summed here from the
GGUF file by the gguf package's own reader (llama.cpp's), not through the code under test: every linear
weight (the output head included: the token table where it is tied) at the format's bytes per weight,
or in `native` at its bytes in the file, plus one embedding row and every norm and bias at float32."""
import os

import gguf
import pytest

from sudu.layers.gguf_native import NATIVE_TYPES
from sudu.quant.formats import GROUP_SIZE
from sudu.commands.roofline import FORMATS, bytes_per_token
from sudu.weights.catalog import CATALOG, DEFAULT_MODEL, pull
from sudu.weights.loader import load_checkpoint
from tests.helpers.gguf_files import write_tiny_gguf

LINEAR = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
INT8_BYTES = 1.0 + 2.0 / GROUP_SIZE  # a linear weight without a native kernel runs at int8's bytes


def expected_bytes(path) -> dict[str, float]:
    """format -> bytes a decode step reads, from the file's tensor table alone."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    embedding = tensors["token_embd.weight"]
    heads = [tensors.get("output.weight", embedding)]  # tied: the head reads the token table
    is_linear = {name: name.endswith(".weight") and name.split(".")[-2] in LINEAR for name in tensors}  # not biases
    linear = [t for name, t in tensors.items() if is_linear[name]] + heads
    other = sum(int(t.n_elements) for name, t in tensors.items()
                if not is_linear[name] and name not in ("output.weight", "token_embd.weight"))
    row = int(embedding.shape[0])  # gguf shapes are innermost first: [hidden, vocab]
    weights = sum(int(t.n_elements) for t in linear)
    out = {fmt: weights * per_linear + (row + other) * per_other
           for fmt, (_, per_linear, per_other) in FORMATS.items() if per_linear is not None}
    out["native"] = sum(int(t.n_bytes) if t.tensor_type.name in NATIVE_TYPES else int(t.n_elements) * INT8_BYTES
                        for t in linear) + (row + other) * 4.0
    return out


def check(path):
    ckpt = load_checkpoint(str(path), progress=False)
    want = expected_bytes(path)
    assert set(want) == set(FORMATS)
    for fmt, value in want.items():
        assert bytes_per_token(ckpt.config, fmt, ckpt) == pytest.approx(value, rel=1e-12), fmt


@pytest.mark.parametrize("arch, tied", [("qwen2", False), ("qwen2", True), ("llama", False), ("gemma3", True)])
def test_roofline_bytes_equal_the_files_tensor_sizes(tmp_path, arch, tied):
    """Tiny files mixing F32, Q8_0, Q5_0 and Q4_0 tensors, with and without a tied head."""
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, tied=tied)
    check(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", [DEFAULT_MODEL] + ([n for n in CATALOG if n != DEFAULT_MODEL]
                                                   if os.environ.get("SUDU_TEST_ALL_REAL") else []))
def test_roofline_bytes_of_the_catalog_models(name):
    """A catalog file with K-quants (Q4_K, Q6_K beside Q5_0, Q8_0), read by the gguf package: its tensor
    table only, but GGUFReader parses the whole vocabulary too, a minute a file on a loaded 2-core machine,
    so the other catalog models (no new tensor type; a tied head is in the tiny files above) run with
    SUDU_TEST_ALL_REAL=1."""
    check(pull(name, progress=False))
