import os

import pytest
import torch

# Under pytest-xdist (pyproject's addopts: a worker per core), each worker, and every process its tests start
# (servers, Ray), runs on cores of its own: two workers' OpenMP teams on shared cores would spin against each
# other. The engines' default thread count follows (config.default_num_threads reads the affinity).
_WORKER, _WORKERS = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKER and _WORKERS > 1 and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    if len(_cores) >= _WORKERS:
        os.sched_setaffinity(0, _cores[int(_WORKER.removeprefix("gw")) % _WORKERS::_WORKERS])
torch.set_num_threads(min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
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
