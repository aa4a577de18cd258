"""The engine's CUDA path: Triton kernels and what runs a step on the GPU without a launch per op.

- paged_attention.py: attention that reads K/V through the block table on the device (decode, speculative
  verification, prefill and mixed chunks in one varlen kernel; GQA, sliding windows, int8 KV);
- quant_linear.py: weight-only int8 / int4 matrix products (the CPU formats' row layout and values);
- step.py: a step's block tables on the device, decode steps captured as CUDA graphs per padded batch size
  with their metadata in static buffers;
- invariance.py: the load-time check that verified rows equal decoded ones (what --speculative needs);
- device_sampler.py lives with the samplers (layers/device_sampler.py): the whole batch sampled on the device.

Triton ships with PyTorch's CUDA builds. Without a GPU its interpreter (TRITON_INTERPRET=1, read when a kernel
is defined) runs the same kernels on the CPU with NumPy: that is how the CPU test suite checks them, and
`triton_available()` says whether they can run at all here.
"""
from __future__ import annotations

import functools
import importlib.util
import os


def interpreted() -> bool:
    """The kernels run in Triton's CPU interpreter (tests without a GPU), not compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Triton is importable (PyTorch's CUDA wheels depend on it; a CPU install has it only if added)."""
    return importlib.util.find_spec("triton") is not None
