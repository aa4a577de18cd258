"""Same request, same answer (docs/exactness.md): greedy tokens and their logprobs, and seeded samples, are bit
for bit the same whatever else the engine computes. Each request alone on an engine without a prefix cache is
the reference; against it: batches of 2, 5 and 16 prompts of mixed lengths, chunk budgets of 16, 64 and
2,048 tokens, prefixes cached up to block boundaries, mid-block and all but the last token, RAM hits, disk
hits, no cache, n-gram and draft-model speculation, the bounded greedy head, on every architecture and
weight format the CPU path ships (int8, int4, a GGUF file's own Q8_0 / Q5_0 / Q4_0 blocks) and with each
kernel instruction set this CPU runs. The default model's check is marked slow."""
from __future__ import annotations

import random

import pytest
import torch

from sudu import kernels
from sudu.engine.llm import LLM
from sudu.sampling import SamplingParams
from tests.helpers.native_blocks import needs_bf16_tiles
from tests.helpers.tiny_models import save_tiny_model

ARCHS = ["qwen2", "llama", "gemma3", "qwen3", "qwen2moe", "qwen3moe", "mixtral", "deepseek_v2", "deepseek_v32"]
LENGTHS = [3, 70, 16, 17, 5, 31, 64, 65, 12, 100, 33, 48, 7, 90, 129, 40]  # 16 prompts, mixed lengths
TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
# the whole arithmetic is fixed: no speculation, the whole head, no cache, one chunk per prompt
REFERENCE = dict(speculative="none", greedy_head="full", enable_prefix_caching=False, kv_cache_dtype="float16",
                 num_threads=1)  # one thread: the suite shares its cores; the slow test runs the default threads


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = random.Random(seed)
    out = []
    for n in lengths:
        motif = [g.randrange(3, 250) for _ in range(g.randrange(3, 9))]
        out.append([motif[i % len(motif)] if g.random() < 0.5 else g.randrange(3, 250) for i in range(n)])
    return out


def answers(results) -> list[tuple[list[int], list[float] | None]]:
    """Tokens and logprobs (with their top alternatives): what must be bit-identical."""
    out = []
    for r in results:
        lps = r.outputs[0].logprobs
        out.append((r.token_ids, None if lps is None else [(t.logprob, t.top) for t in lps]))
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance_models")
    dirs = {arch: save_tiny_model(root / arch, arch) for arch in ARCHS}
    dirs["draft"] = save_tiny_model(root / "draft", "qwen2", seed=5)
    from tests.helpers.gguf_files import write_tiny_gguf

    write_tiny_gguf(root / "qwen2.gguf", "qwen2")
    dirs["qwen2-gguf"] = root / "qwen2.gguf"
    for arch in ("qwen2", "gemma3"):  # heads of 32: the bfloat16 tiles take them
        dirs[f"{arch}-hd32"] = save_tiny_model(root / f"{arch}-hd32", arch, head_dim=32)
    return dirs


@pytest.fixture(scope="module")
def engines(model_dirs):
    """(model, format, **config) -> an LLM, built once per module."""
    cache: dict = {}

    def get(model: str, fmt: str, **cfg) -> LLM:
        merged = {**REFERENCE, **cfg}
        key = (model, fmt, tuple(sorted(merged.items())))
        if key not in cache:
            cache[key] = LLM(str(model_dirs[model]), progress=False, quantization=fmt, **merged)
        return cache[key]

    return get


def reference(engines, model: str, fmt: str, prompts, params=GREEDY) -> list:
    """Each prompt alone, nothing cached, one chunk."""
    llm = engines(model, fmt)
    return [answers(llm.generate([p], params))[0] for p in prompts]


# attention's two arithmetics (engine/attention_choice.py); the bfloat16 tiles only where the CPU has them,
# and the test says so where it does not
ARITHMETICS = ["float32", pytest.param("bfloat16", marks=needs_bf16_tiles)]


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("window,ring", [(None, False), (8, False), (8, True), (100, True)])
def test_attention_row_is_the_same_in_every_kernel_and_chunking(kind, window, ring, arithmetic):
    """Every query row of a 150-position sequence, computed by the prompt kernel in one chunk, in chunks over
    cached keys, and by the decode kernel one row at a time, beside other sequences and as verification-like
    runs of 5: bit-identical. With `ring`, a sliding layer's own key list that starts past position 0."""
    from sudu.layers import attention as A
    from sudu.layers.kv_cache import make_kv_cache

    g = torch.Generator().manual_seed(3)
    # the tiles: three 32-channel chunks, so that the scores sum chunk after chunk in both operand orders
    n, heads, kv_heads, dim = 150, 4, 2, 16 if arithmetic == "float32" else 96
    cache = make_kv_cache(kind, 256, kv_heads, dim, torch.float32)
    cache.bf16_tiles = arithmetic == "bfloat16"
    if kind == "int8":
        cache.set_range(0.5 + 3.5 * torch.rand(kv_heads, dim, generator=g), 0.5 + 3.5 * torch.rand(kv_heads, dim, generator=g))
    slots = torch.randperm(256, generator=g)[:n]
    q = torch.randn(n, heads, dim, generator=g)
    k, v = torch.randn(n, kv_heads, dim, generator=g), torch.randn(n, kv_heads, dim, generator=g)
    cache.write(slots, k, v)

    def attend(seqs: list[tuple[int, int]]) -> torch.Tensor:
        """Sequences given as (first new position, end): their new rows' outputs, flat."""
        q_lens = [e - s for s, e in seqs]
        ctx = [slots[:e] for _, e in seqs]
        keys = [(max(0, s + 1 - window), slots[max(0, s + 1 - window):e]) for s, e in seqs] if ring else None
        meta = A.build_metadata(q_lens, ctx, [cache], window, keys)
        rows = torch.cat([torch.arange(s, e) for s, e in seqs])
        return A.paged_attention(q[rows], k[rows], v[rows], 0, meta, dim ** -0.5, sliding=window is not None)

    whole = attend([(0, n)])
    assert A.prompt_kernel(q, cache, torch.float32) is not None and A.decode_kernel(q, cache, 1) is not None
    chunks = torch.cat([attend([(s, e)]) for s, e in [(0, 37), (37, 101), (101, 150)]])
    assert torch.equal(chunks, whole)
    assert torch.equal(torch.cat([attend([(s, s + 16)]) for s in range(0, 144, 16)] + [attend([(144, 150)])]), whole)
    decoded = torch.cat([attend([(p, p + 1)]) for p in range(0, n, 3)])
    assert torch.equal(decoded, whole[::3])
    batched = attend([(p, p + 1) for p in (149, 3, 70, 64, 63, 0)])  # one decode step of six sequences
    assert torch.equal(batched, whole[[149, 3, 70, 64, 63, 0]])
    verify = attend([(60, 65), (140, 145), (2, 7)])  # 5 rows each: the decode kernel's multi-row path
    assert torch.equal(verify, whole[list(range(60, 65)) + list(range(140, 145)) + list(range(2, 7))])
    # the CPU pools keep each kv head's rows together (kv_pool); slot-major copies of them compute the same
    assert cache.k.stride(1) == 256 * dim
    cache.k, cache.v = cache.k.contiguous(), cache.v.contiguous()
    assert torch.equal(attend([(0, n)]), whole) and torch.equal(verify, attend([(60, 65), (140, 145), (2, 7)]))


MATRIX = [(arch, "int8") for arch in ARCHS] + [("qwen2", "int4"), ("gemma3", "int4"), ("qwen2moe", "int4"),
                                               ("qwen2-gguf", "auto")]


@pytest.mark.parametrize("model,fmt", MATRIX)
def test_rows_do_not_depend_on_batch_or_chunks(engines, model, fmt):
    prompts = prompts_of(LENGTHS, seed=1)
    ref = reference(engines, model, fmt, prompts)
    llm = engines(model, fmt)
    assert answers(llm.generate(prompts[:2], GREEDY)) == ref[:2]
    assert answers(llm.generate(prompts[2:7], GREEDY)) == ref[2:7]
    assert answers(llm.generate(prompts, GREEDY)) == ref  # 16 prompts, one chunk each (2,048 budget)
    for budget in (16, 64):
        assert answers(engines(model, fmt, max_num_batched_tokens=budget).generate(prompts, GREEDY)) == ref, budget


@needs_bf16_tiles
@pytest.mark.parametrize("model", ["qwen2-hd32", "gemma3-hd32"])
def test_bf16_tile_attention_keeps_every_answer(engines, model):
    """The bfloat16-tile arithmetic (auto's choice on an AMX machine for a float16 pool) gives each request
    the answer it gets alone: in batches, in chunks of 16, over a cached prefix and under n-gram speculation."""
    prompts = prompts_of(LENGTHS, seed=6)
    llm = engines(model, "int8")
    assert llm.engine.runner.attention_arithmetic == "bfloat16"  # auto took the tiles: the test tests them
    ref = reference(engines, model, "int8", prompts)
    assert answers(llm.generate(prompts, GREEDY)) == ref
    assert answers(engines(model, "int8", max_num_batched_tokens=16).generate(prompts, GREEDY)) == ref
    cached = engines(model, "int8", enable_prefix_caching=True, sliding_window_kv="full")
    cached.generate([p[:len(p) // 2] for p in prompts], SamplingParams(max_tokens=1))
    got = cached.generate(prompts, GREEDY)
    assert sum(r.num_cached_tokens for r in got) > 0
    assert answers(got) == ref
    spec = engines(model, "int8", speculative="ngram", speculative_max_batch=64)
    assert answers(spec.generate(prompts, GREEDY)) == ref
    assert spec.engine.speculator.num_draft_tokens > 0
    # float32 is the other recipe: its logprobs differ from the tiles' (so the tiles really ran above), and it
    # is invariant on its own
    f32 = engines(model, "int8", attention_arithmetic="float32")
    assert f32.engine.runner.attention_arithmetic == "float32"
    alone = [answers(f32.generate([p], GREEDY))[0] for p in prompts[:5]]
    assert answers(f32.generate(prompts[:5], GREEDY)) == alone
    assert alone != ref[:5]


SPLITS = [16, 32, 20, 40, 64]  # 1 and 2 blocks, mid-block, all but the last token (prompts of 65)


@pytest.mark.parametrize("model,fmt", [("qwen2", "int8"), ("gemma3", "int8"), ("qwen3moe", "int8"),
                                       ("deepseek_v2", "int8"), ("qwen2", "int4"), ("qwen2-gguf", "auto")])
def test_cached_prefix_gives_the_uncached_answer(engines, model, fmt):
    prompts = prompts_of([65] * len(SPLITS), seed=2)
    ref = reference(engines, model, fmt, prompts)
    # gemma3's sliding layers keep every position where the prefix cache is on
    llm = engines(model, fmt, enable_prefix_caching=True, sliding_window_kv="full")
    for split, prompt, want in zip(SPLITS, prompts, ref):
        llm.generate([prompt[:split]], SamplingParams(max_tokens=1))
        got = llm.generate([prompt], GREEDY)[0]
        assert got.num_cached_tokens == split // 16 * 16, split  # the cache really served the prefix
        assert answers([got]) == [want], split


def test_disk_hit_equals_ram_hit_equals_no_cache(engines, model_dirs, tmp_path):
    prompts = prompts_of([65, 50, 90], seed=3)
    ref = reference(engines, "qwen2", "int8", prompts)
    cfg = dict(REFERENCE, enable_prefix_caching=True, disk_cache_size="64MiB", disk_cache_dir=str(tmp_path))
    warm = LLM(str(model_dirs["qwen2"]), progress=False, quantization="int8", **cfg)
    warm.generate([p[:48] for p in prompts], SamplingParams(max_tokens=1))
    ram = [warm.generate([p], GREEDY)[0] for p in prompts]
    assert [r.num_cached_tokens for r in ram] == [48, 48, 48]
    assert answers(ram) == ref
    warm.close()
    cold_process = LLM(str(model_dirs["qwen2"]), progress=False, quantization="int8", **cfg)
    disk = [cold_process.generate([p], GREEDY)[0] for p in prompts]
    assert all(r.num_cached_tokens_disk > 0 for r in disk)  # the disk tier really served them
    assert answers(disk) == ref
    cold_process.close()


@pytest.mark.parametrize("model,fmt,spec", [("qwen2", "int8", "ngram"), ("qwen2", "int4", "ngram"),
                                            ("qwen2-gguf", "auto", "ngram"), ("qwen2", "int8", "draft"),
                                            ("qwen2", "int4", "draft")])  # the draft shares the tiny tokenizer
def test_speculation_gives_plain_decoding_bit_for_bit(engines, model_dirs, model, fmt, spec):
    prompts = prompts_of(LENGTHS, seed=4)
    ref = reference(engines, model, fmt, prompts)
    drafter = "ngram" if spec == "ngram" else f"draft:{model_dirs['draft']}"
    llm = engines(model, fmt, speculative=drafter, speculative_max_batch=64)
    assert answers(llm.generate(prompts[:5], GREEDY)) == ref[:5]
    assert answers(llm.generate(prompts, GREEDY)) == ref
    assert llm.engine.speculator.num_draft_tokens > 0  # drafts were really verified


@pytest.mark.parametrize("model,fmt", [("qwen2", "int8"), ("llama", "int8"), ("qwen2-gguf", "auto")])
def test_bounded_head_gives_the_whole_heads_tokens(engines, model, fmt, monkeypatch):
    """The tiny vocabulary is below the bounded head's MIN_VOCAB and its bound loose: both lifted, so that
    steps of up to four greedy rows take it."""
    from sudu.layers import bounded_head

    monkeypatch.setattr(bounded_head, "MIN_VOCAB", 0)
    monkeypatch.setattr(bounded_head, "MAX_TILE_FRACTION", 1.0)
    prompts = prompts_of(LENGTHS[:8], seed=5)
    tokens_only = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    ref = [t for t, _ in reference(engines, model, fmt, prompts, tokens_only)]
    llm = engines(model, fmt, greedy_head="auto")
    assert llm.engine.runner.bounded_head is not None
    assert [r.token_ids for r in llm.generate(prompts[:2], tokens_only)] == ref[:2]  # steps the bounded head serves
    assert [llm.generate([p], tokens_only)[0].token_ids for p in prompts] == ref
    head = llm.engine.runner.bounded_head
    assert head.calls - head.whole_head > TOKENS  # steps really took the bounded head


def test_seeded_sampling_ignores_neighbours_and_cache(engines):
    prompts = prompts_of(LENGTHS[:8], seed=6)
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=TOKENS, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    alone = [answers(engines("qwen2", "int8").generate([p], s))[0] for p, s in zip(prompts, seeded)]
    # beside unseeded and greedy neighbours that draw from the shared generator at other times
    others = prompts_of([20, 9, 44], seed=7)
    mixed = prompts + others
    params = seeded + [SamplingParams(temperature=1.0, max_tokens=TOKENS + 3), GREEDY,
                       SamplingParams(temperature=0.5, max_tokens=5)]
    assert answers(engines("qwen2", "int8").generate(mixed, params))[:len(prompts)] == alone
    assert answers(engines("qwen2", "int8", max_num_batched_tokens=16).generate(prompts, seeded)) == alone
    warm = engines("qwen2", "int8", enable_prefix_caching=True)
    warm.generate(prompts, [SamplingParams(max_tokens=1)] * len(prompts))
    hot = warm.generate(prompts, seeded)
    assert any(r.num_cached_tokens for r in hot)
    assert answers(hot) == alone
    # and the seed matters: another seed gives other tokens somewhere
    reseeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=999 + i, max_tokens=TOKENS, ignore_eos=True)
                for i in range(len(prompts))]
    assert [r.token_ids for r in engines("qwen2", "int8").generate(prompts, reseeded)] != [a[0] for a in alone]


def kernel_isas() -> list:
    """The dot-product instruction sets of the quantized kernels (kernels.h KernelOptions::vnni and ::amx),
    each one this CPU lacks reported as skipped with the reason."""
    ext = kernels.load()
    assert ext is not None, f"the native kernels did not load: {kernels.disabled_reason() or 'compile failed'}"
    return ["avx2", pytest.param("avx512vnni", marks=pytest.mark.skipif(
        not ext.cpu_has_vnni(), reason="this CPU lacks AVX-512 VNNI: its kernels are not exercised here")),
        pytest.param("amx", marks=pytest.mark.skipif(
            not ext.cpu_has_amx(), reason="this CPU lacks AMX int8 tiles, or the OS does not grant them: "
                                          "their kernels are not exercised here"))]


@pytest.mark.parametrize("name", kernel_isas())
@pytest.mark.parametrize("model,fmt", [("qwen2", "int8"), ("qwen2", "int4"), ("qwen2-gguf", "auto"), ("qwen2moe", "int8")])
def test_each_instruction_set_is_invariant_and_they_agree(engines, name, model, fmt):
    prompts = prompts_of(LENGTHS, seed=8)
    native_ref = reference(engines, model, fmt, prompts)
    # amx: AMX tiles from 16 rows (every prompt chunk of 16+ rows), the VNNI kernels for the rest
    amx = {"amx": name == "amx", **({"amx_min_rows": 16} if name == "amx" else {})}
    with kernels.options(vnni=name != "avx2", **amx) as ext:
        assert ext.isa() == name
        ref = reference(engines, model, fmt, prompts)
        assert answers(engines(model, fmt).generate(prompts, GREEDY)) == ref
        assert answers(engines(model, fmt, max_num_batched_tokens=16).generate(prompts, GREEDY)) == ref
    assert ref == native_ref  # the same integers and float steps on either instruction set


def test_fast_math_is_opt_in():
    from sudu.config import EngineConfig
    from sudu.layers import linear

    assert EngineConfig().fast_math is False
    assert linear.PREFILL_MIN_ROWS == linear.NEVER  # the invariant default: the integer kernel at every row count
    assert linear.fast_prefill(False) == (linear.PREFILL_DTYPE, linear.NEVER)
    assert linear.fast_prefill(True) == linear.prefill_path()


@pytest.mark.slow
def test_default_model_answers_do_not_depend_on_batch_chunks_or_cache():
    """The catalog's default model (its Q4_K / Q5_0 / Q6_K / Q8_0 blocks), with the engine's defaults."""
    from benchmarks.invariance import PROMPTS

    llm = LLM(progress=False, enable_prefix_caching=False)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    ref = [answers(llm.generate([p], params))[0] for p in prompts]
    assert answers(llm.generate(prompts, params)) == ref
    assert answers(LLM(progress=False, enable_prefix_caching=False, max_num_batched_tokens=64).generate(prompts, params)) == ref
    warm = LLM(progress=False)
    for p, want in zip(prompts, ref):
        warm.generate([p[:len(p) * 3 // 4]], SamplingParams(max_tokens=1))
        assert answers(warm.generate([p], params)) == [want]
