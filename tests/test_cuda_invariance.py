"""The load-time check that gates `--speculative` off the CPU (sudu/cuda/invariance.py), on the CUDA path's
step: in Triton's interpreter on the CPU (SUDU_CUDA_PATH_ON_CPU=1), on the GPU where there is one.

It must pass where verification rows equal plain decoding's, and must catch a network whose rows depend on the
batch, with the figures in its refusal.
"""
import pytest
import torch

pytest.importorskip("triton")

from sudu.cuda.invariance import check_speculation, verification_matches_decoding  # noqa: E402
from sudu.errors import SuduError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def runner(tiny_model_dirs, monkeypatch):
    from sudu.engine.llm import LLM

    monkeypatch.setenv("SUDU_CUDA_PATH_ON_CPU", "1")
    # int8: on the CPU the quantized kernels, on a GPU the Triton ones, batch-invariant either way (float32
    # weights through the CPU's GEMM are not: the check finds their rows differ in the last bits)
    llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, device=DEVICE, dtype="float32", quantization="int8",
              kv_cache_dtype="float32", speculative="none")
    assert llm.engine.runner.cuda_step is not None
    return llm.engine.runner


def test_rows_of_the_cuda_path_verify_as_they_decode(runner):
    ok, account = verification_matches_decoding(runner)
    assert ok, account
    assert "5/5 rows equal to the same tokens decoded alone" in account
    check_speculation(runner)


def test_a_network_whose_rows_depend_on_the_batch_is_refused(runner, monkeypatch):
    head = runner.model.compute_logits
    # the last bits of every logit move with the number of rows in the call: what a shape-picked GEMM can do
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: head(h) * (1 + 1e-6 * h.shape[0]))
    ok, account = verification_matches_decoding(runner)
    assert not ok and "0/5 rows equal" in account
    with pytest.raises(SuduError, match="would not be lossless.*--quantization int8 or int4"):
        check_speculation(runner)
