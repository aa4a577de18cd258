import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# without a GPU, the CUDA path's Triton kernels (sudu/cuda/) run in Triton's CPU interpreter; the variable is
# read when a kernel is defined, so it is set before anything imports them
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """arch -> a saved tiny random model directory (built once per test session)."""
    from tests.helpers.tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: save_tiny_model(root / arch, arch) for arch in ("qwen2", "llama", "gemma3")}


@pytest.fixture(scope="session")
def gguf_readers_once():
    """transformers' GGUF loading reads each catalog file once per session (tests/helpers/hf_gguf.py)."""
    from tests.helpers.hf_gguf import readers_once

    with readers_once():
        yield
