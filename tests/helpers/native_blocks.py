"""Random GGUF blocks for the native kernels' tests, and the instruction sets this CPU can run them on."""
import numpy as np
import pytest

from sudu import kernels
from sudu.weights.gguf import QuantizedTensor




# bytes per block and the offsets of its float16 fields (d, and dmin / m)
BLOCKS = {"Q8_0": (32, 34, [0]), "Q4_0": (32, 18, [0]), "Q4_1": (32, 20, [0, 2]), "Q5_0": (32, 22, [0]),
          "Q4_K": (256, 144, [0, 2]), "Q5_K": (256, 176, [0, 2]), "Q6_K": (256, 210, [208])}


def random_tensor(ggml_type: str, n: int, k: int, seed: int = 0, permute: bool = False) -> QuantizedTensor:
    """A GGUF tensor of random blocks: every bit pattern is a valid block once its float16 fields are finite."""
    per, size, f16_at = BLOCKS[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for at in f16_at:
        scale = rng.uniform(0.2, 1.0, size=(n, k // per)) * (0.01 if ggml_type.endswith("_K") else 0.05)
        sign = 1 if at == 0 or ggml_type != "Q4_1" else -1
        blocks[:, :, at:at + 2] = (sign * scale).astype(np.float16).view(np.uint8).reshape(n, k // per, 2)
    perm = rng.permutation(n) if permute else None
    return QuantizedTensor("w", "w", ggml_type, (n, k), blocks.reshape(n, -1), row_permutation=perm)


def saturated_tensor(ggml_type: str, n: int, k: int) -> QuantizedTensor:
    """A tensor whose codes and sub-block scales are all at their largest (every bit set; the float16 scales
    kept from random_tensor): against activations that round to +-127 its products give the integer sums
    furthest from zero."""
    qt = random_tensor(ggml_type, n, k)
    per, size, f16_at = BLOCKS[ggml_type]
    blocks = qt.blocks.reshape(n, k // per, size)
    fields = np.zeros(size, dtype=bool)
    for at in f16_at:
        fields[at:at + 2] = True
    blocks[:, :, ~fields] = 0xFF
    return QuantizedTensor("w", "w", ggml_type, (n, k), blocks.reshape(n, -1))


def isas() -> list[str]:
    """The kernels' instruction sets to test here: AVX2 always, the AVX-512 VNNI path where the CPU has it, and
    AMX's int8 tiles where the CPU has them and the OS grants them (none without the kernels: their tests
    skip)."""
    ext = kernels.load()
    if ext is None:
        return []
    return ["avx2"] + (["avx512vnni"] if ext.cpu_has_vnni() else []) + (["amx"] if ext.cpu_has_amx() else [])


def bf16_tiles() -> bool:
    """Whether this CPU runs attention's bfloat16 tiles (AMX-BF16 granted; never without the kernels)."""
    ext = kernels.load()
    return ext is not None and ext.bf16_tiles_granted()


# a test of the bfloat16 tiles, reported as skipped with the reason where the CPU has none
needs_bf16_tiles = pytest.mark.skipif(not bf16_tiles(),
                                      reason="this CPU has no AMX bfloat16 tiles (or the OS does not grant them)")


def on_isa(name: str):
    """A block run on the kernels' `name` path ("avx2", "avx512vnni" or "amx": AMX tiles from 16 rows, the
    VNNI kernels below), the CPU's best restored after it."""
    if name == "amx":
        return kernels.options(vnni=True, amx=True, amx_min_rows=16)
    return kernels.options(vnni=name == "avx512vnni", amx=False)
