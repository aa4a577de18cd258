"""Where the engine runs (`--device`) and in which dtype (`--dtype`), and what each device supports.

CPU: the native kernels (kernels/): int8 / int4 weights, the one-call decode stack, the paged attention
kernel, float32 activations by default.

CUDA: the same network and scheduler on PyTorch's CUDA kernels. Weights run in --dtype (bfloat16 by
default; `--quantization auto` is none there, and GGUF checkpoints are dequantized at load), or with
`--quantization int8 | int4` as the CPU formats' codes on Triton kernels (cuda/quant_linear.py; needs
triton, which PyTorch's CUDA wheels bring). With triton, attention reads the paged pool in place through the
block tables (cuda/paged_attention.py) and decode steps replay CUDA graphs captured per padded batch size
(cuda/step.py, `--cuda-graph-max-batch`); without it, SDPA over the pool gathered per step. Either way the
step's metadata is built on the host and copied over once. The whole batch is
sampled on the device (layers/device_sampler.py: penalties, filters and draws as batched tensor ops)
and only the chosen ids, with any logprobs asked for, come back; its draws come from a counter-based
generator, so a seed reproduces run to run and whatever shares the batch, though not the CPU sampler's
draws for that seed. Not on CUDA yet, refused at load with a clear error:
- `--quantization native`: the GGUF files' own blocks run on the CPU kernels only;
- `--speculative draft:MODEL | mtp`: only n-gram drafting runs there so far.
`--speculative ngram` runs on CUDA with triton for greedy requests, if the engine finds at load that it is
lossless there (cuda/invariance.py): greedy speculation is lossless when a token's logits inside a verification
run equal, bit for bit, the same token's decoded alone. The CPU kernels guarantee it by construction; on CUDA
the paged attention and the int8 / int4 kernels are built for it (tiles fixed whatever the batch), but
bfloat16 weights go through cuBLAS, which picks kernels by shape, and PyTorch's norms may reduce a row
differently at another batch size, so the engine measures it on the GPU, format and dtype it runs and refuses
with the figures where it does not hold. auto stays none on CUDA until that is measured on a GPU.
"""
from __future__ import annotations

import torch

from sudu.cuda import triton_available
from sudu.errors import SuduError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KERNEL_FORMATS = ("native", "int8", "int4")  # weight formats that run on the CPU kernels (layers/linear.py)


def resolve_device(name: str) -> torch.device:
    """`--device` -> a torch.device; auto picks CUDA when torch sees a GPU. A clear error when CUDA is asked
    for and absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SuduError(f"--device {name}: this PyTorch build sees no CUDA GPU "
                            f"(torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SuduError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def resolve_dtype(config) -> torch.dtype:
    """`--dtype` -> torch dtype; auto is float32 on the CPU, bfloat16 on CUDA."""
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    return torch.bfloat16 if resolve_device(config.device).type == "cuda" else torch.float32


def check_supported(config) -> None:
    """Refuse, before anything loads, what the chosen device cannot run (see the module docstring)."""
    device = resolve_device(config.device)
    if device.type == "cpu":
        return
    if config.quantization == "native":
        raise SuduError(f"--quantization native runs on sudu's CPU kernels only; on {device} use --quantization "
                        "int8, int4 or none (auto: none, the weights in --dtype)")
    if config.quantization in ("int8", "int4") and not triton_available():
        raise SuduError(f"--quantization {config.quantization} on {device} runs on Triton kernels, and triton is "
                        "not installed (PyTorch's CUDA wheels bring it); install triton or use --quantization none")
    if config.speculative not in ("none", "auto", "ngram"):
        raise SuduError(f"--speculative {config.speculative} runs on the CPU engine only for now; on {device} use "
                        "--speculative ngram (checked to be lossless at load) or none")
    if config.speculative == "ngram" and not triton_available():
        raise SuduError(f"--speculative ngram on {device} needs the CUDA path's Triton kernels, and triton is not "
                        "installed (PyTorch's CUDA wheels bring it)")
