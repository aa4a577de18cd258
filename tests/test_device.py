"""The engine off the CPU (engine/placement.py).

Everywhere: `--device` / `--dtype` resolve as documented and what CUDA cannot run yet is refused before
anything loads. Where torch sees a CUDA GPU (not in CI, which has none; run on a GPU machine with
`python -m pytest tests/test_device.py`): the engine's output on the GPU is checked token by token against
transformers run on the same GPU, teacher-forced, so a near-tie between two logits cannot fail it but a wrong
KV slot, mask or rotary position can.
"""
import os

import pytest
import torch

from sudu.config import EngineConfig
from sudu.engine import placement
from sudu.engine.placement import check_supported, resolve_device, resolve_dtype
from sudu.errors import SuduError
from sudu.sampling import SamplingParams
from tests.helpers.greedy import prompts_of
from tests.helpers.tiny_models import build_hf_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
# the GPU tests' device; `SUDU_TEST_DEVICE=cpu` runs their bodies on the CPU's PyTorch path (a dry run of the
# tests themselves; the skip still needs a GPU unless it is set)
DEVICE = os.environ.get("SUDU_TEST_DEVICE", "cuda")
needs_cuda = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="torch sees no CUDA GPU")


def test_device_and_dtype_resolve_as_documented(monkeypatch):
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="tpu").validate()
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="fp8").validate()
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype(EngineConfig(device="cpu")) == torch.float32
    assert resolve_dtype(EngineConfig(device="cpu", dtype="bfloat16")) == torch.bfloat16
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(SuduError, match="sees no CUDA GPU"):
            resolve_device("cuda")
    # what a GPU machine would resolve to (no GPU is touched: these only read torch.cuda's answers)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_dtype(EngineConfig()) == torch.bfloat16
    with pytest.raises(SuduError, match="only 1 CUDA device"):
        resolve_device("cuda:1")
    check_supported(EngineConfig(device="cuda"))  # auto weights, float KV or int8 KV: fine
    check_supported(EngineConfig(device="cuda", kv_cache_dtype="int8"))
    with pytest.raises(SuduError, match="CPU kernels only.*int8, int4 or none"):
        check_supported(EngineConfig(device="cuda", quantization="native"))
    for fmt in ("int8", "int4"):  # the Triton kernels (sudu/cuda/quant_linear.py)
        monkeypatch.setattr(placement, "triton_available", lambda: True)
        check_supported(EngineConfig(device="cuda", quantization=fmt))
        monkeypatch.setattr(placement, "triton_available", lambda: False)
        with pytest.raises(SuduError, match="triton is not installed"):
            check_supported(EngineConfig(device="cuda", quantization=fmt))
    for spec in ("mtp", "draft:qwen2.5-coder-0.5b-instruct"):
        with pytest.raises(SuduError, match="CPU engine only"):
            check_supported(EngineConfig(device="cuda", speculative=spec))
    with pytest.raises(SuduError, match="ngram on cuda needs the CUDA path's Triton kernels"):
        check_supported(EngineConfig(device="cuda", speculative="ngram"))
    monkeypatch.setattr(placement, "triton_available", lambda: True)
    check_supported(EngineConfig(device="cuda", speculative="ngram"))  # then measured at load (cuda/invariance.py)
    check_supported(EngineConfig(device="cpu", quantization="int4", speculative="ngram"))


def test_cli_refuses_a_missing_gpu_in_one_line(tiny_model_dirs, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from sudu.cli import main

    rc = main(["generate", str(tiny_model_dirs["qwen2"]), "hi", "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc != 0 and "sees no CUDA GPU" in err and "Traceback" not in err


def teacher_forced_check(hf, prompt, tokens, logprobs, tol_logit, tol_logprob):
    """Run the reference over prompt + tokens once; every generated token must be the reference's argmax up
    to tol_logit (a near-tie may go either way), and its logprob the reference's up to tol_logprob. Returns
    the share of tokens that are exactly the reference's argmax."""
    device = next(hf.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
    ref_lp = torch.log_softmax(logits, dim=-1)
    exact = 0
    for i, tok in enumerate(tokens):
        assert logits[i, tok] >= logits[i].max() - tol_logit, f"token {i}: {tok} is not the reference's choice"
        assert abs(logprobs[i] - ref_lp[i, tok].item()) <= tol_logprob, f"token {i}: logprob off"
        exact += int(tok == int(logits[i].argmax()))
    return exact / len(tokens)


def generate_checked(llm, hf, prompts, max_tokens, tol_logit, tol_logprob):
    results = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, logprobs=0, **GREEDY))
    shares = []
    for p, r in zip(prompts, results):
        assert len(r.token_ids) == max_tokens and r.finish_reason == "length"
        lps = [lp.logprob for lp in r.outputs[0].logprobs]
        shares.append(teacher_forced_check(hf, p, r.token_ids, lps, tol_logit, tol_logprob))
    return sum(shares) / len(shares)


@needs_cuda
@pytest.mark.parametrize("arch", ["qwen2", "llama", "gemma3"])
def test_cuda_float32_matches_transformers_on_the_gpu(arch, tiny_model_dirs):
    """float32 on the GPU (TF32 off): continuous batching of mixed lengths, prompts past the gemma window,
    chunked prefill riding along with decodes."""
    from sudu.engine.llm import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = build_hf_model(arch, seed=0).to(DEVICE).eval()
    llm = LLM(str(tiny_model_dirs[arch]), progress=False, device=DEVICE, dtype="float32", kv_cache_dtype="float32",
              max_num_batched_tokens=32)
    runner = llm.engine.runner
    assert runner.device.type == DEVICE and runner.kv_caches[0].k.device.type == DEVICE
    prompts = prompts_of([3, 11, 20, 40, 70, 1, 33, 9], seed=1)
    share = generate_checked(llm, hf, prompts, 16, tol_logit=1e-3, tol_logprob=1e-3)
    assert share >= 0.95
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@needs_cuda
def test_cuda_default_dtype_is_bfloat16_and_close_to_float32(tiny_model_dirs):
    from sudu.engine.llm import LLM

    hf = build_hf_model("qwen2", seed=0).to(DEVICE).eval()
    if DEVICE == "cuda":  # device auto -> cuda, dtype auto -> bfloat16
        llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False)
    else:
        llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, device=DEVICE, dtype="bfloat16")
    assert llm.engine.runner.dtype == torch.bfloat16
    assert next(llm.engine.runner.model.parameters()).device.type == DEVICE
    share = generate_checked(llm, hf, prompts_of([5, 30, 64], seed=2), 12, tol_logit=0.15, tol_logprob=0.15)
    assert share >= 0.8


@needs_cuda
def test_cuda_int8_kv_cache(tiny_model_dirs):
    from sudu.engine.llm import LLM

    hf = build_hf_model("qwen2", seed=0).to(DEVICE).eval()
    llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, device=DEVICE, dtype="float32", kv_cache_dtype="int8")
    cache = llm.engine.runner.kv_caches[0]
    assert cache.k.dtype == torch.int8 and cache.k.device.type == DEVICE and cache.k_scale.device.type == DEVICE
    share = generate_checked(llm, hf, prompts_of([20, 45], seed=3), 12, tol_logit=0.5, tol_logprob=0.5)
    assert share >= 0.8


@needs_cuda
def test_cuda_seeded_sampling_is_reproducible(tiny_model_dirs):
    from sudu.engine.llm import LLM

    llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, device=DEVICE, dtype="float32")
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    prompt = prompts_of([12], seed=4)
    assert llm.generate(prompt, params)[0].token_ids == llm.generate(prompt, params)[0].token_ids


@needs_cuda
@pytest.mark.parametrize("fmt,tol", [("int8", 0.05), ("int4", 0.3)])
def test_cuda_quantized_weights_run_on_the_triton_kernels(fmt, tol, tiny_model_dirs):
    """--quantization int8 / int4 on the GPU: every projection a TritonQuantizedLinear on the device, its tokens
    teacher-forced through the float32 reference. Tolerance: bfloat16's own on this model (0.15 nats, as in
    test_cuda_default_dtype_is_bfloat16_and_close_to_float32) plus the format's on the CPU (tests/test_linear.py:
    int8 0.02 from a ~0.5% weight error, here rounded up to 0.05; int4 0.3 from ~8%); the two errors add at
    worst (the CPU dry run, SUDU_TEST_DEVICE=cpu, stays within 0.01 / 0.03 nats). The share of exact argmaxes
    is below bfloat16's 0.8 bar: int4 moves near-ties."""
    from sudu.cuda.quant_linear import TritonQuantizedLinear
    from sudu.engine.llm import LLM
    from sudu.layers.linear import QuantizedLinear

    layer_type = TritonQuantizedLinear if DEVICE == "cuda" else QuantizedLinear  # the dry run: the CPU's layers

    hf = build_hf_model("qwen2", seed=0).to(DEVICE).eval()
    llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, device=DEVICE, dtype="bfloat16", quantization=fmt)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, layer_type)]
    assert layers and not any(type(m) is torch.nn.Linear for m in model.modules())
    assert all(m.fmt == fmt and m.qweight.device.type == DEVICE for m in layers)
    share = generate_checked(llm, hf, prompts_of([5, 30, 64], seed=2), 12, tol_logit=tol + 0.15, tol_logprob=tol + 0.15)
    assert share >= 0.7


@needs_cuda
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_cuda_graph_replays_match_transformers(arch, tiny_model_dirs):
    """Decode steps replayed from CUDA graphs (five sequences padded to eight rows, gemma's ring pool past its
    window), teacher-forced against transformers; on the CPU (SUDU_TEST_DEVICE=cpu with
    SUDU_CUDA_PATH_ON_CPU=1) the same static buffers run without capture."""
    from sudu.engine.llm import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = build_hf_model(arch, seed=0).to(DEVICE).eval()
    llm = LLM(str(tiny_model_dirs[arch]), progress=False, device=DEVICE, dtype="float32", kv_cache_dtype="float32",
              cuda_graph_max_batch=8, max_num_batched_tokens=32)
    step = llm.engine.runner.cuda_step
    if step is None:
        pytest.skip("the CUDA path's step needs triton (and SUDU_CUDA_PATH_ON_CPU=1 on the CPU)")
    assert step.sizes == [1, 2, 4, 8] and (DEVICE != "cuda" or sorted(step.graphs) == step.sizes)
    share = generate_checked(llm, hf, prompts_of([5, 17, 30, 2, 9], seed=7), 16, tol_logit=1e-3, tol_logprob=1e-3)
    assert share >= 0.95 and step.replays > 0


@needs_cuda
def test_cuda_ngram_speculation_is_lossless_or_refused(tiny_model_dirs):
    """int8 weights on the Triton kernels: the load-time check (cuda/invariance.py) either finds verification
    lossless, and then greedy outputs equal plain decoding's with drafts verified, or refuses with its figures."""
    from sudu.engine.llm import LLM

    kw = dict(progress=False, device=DEVICE, dtype="bfloat16", quantization="int8")
    prompts = [p * 3 for p in prompts_of([6, 9, 4], seed=8)]  # repeated text: n-gram drafts find matches
    params = SamplingParams(max_tokens=24, **GREEDY)
    plain = [r.token_ids for r in LLM(str(tiny_model_dirs["qwen2"]), speculative="none", **kw).generate(prompts, params)]
    try:
        llm = LLM(str(tiny_model_dirs["qwen2"]), speculative="ngram", **kw)
    except SuduError as exc:
        assert "would not be lossless" in str(exc) and "rows equal" in str(exc)
        return
    assert [r.token_ids for r in llm.generate(prompts, params)] == plain
    assert llm.engine.speculator.num_draft_tokens > 0
