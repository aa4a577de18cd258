"""Memory: KV pools that take host memory as they fill, and the engine's memory report (weights, KV pools,
resident set) in its stats and on /metrics."""
import torch

from sudu.engine.memory import kv_pool_tensors
from sudu.host.memory import resident_bytes, rss_bytes
from sudu.layers.kv_cache import zeroed_pool


def test_a_zeroed_pool_is_zero_and_resident_only_where_written():
    before = rss_bytes()
    pool = zeroed_pool((1 << 22, 2, 16), torch.float32)  # 512 MiB
    assert rss_bytes() - before < 64 << 20
    assert resident_bytes([pool]) < 1 << 20
    assert float(pool[123_456].abs().sum()) == 0.0 and pool.is_contiguous()
    pool[:65536] = 1.0  # 8 MiB written
    assert 8 << 20 <= resident_bytes([pool]) < 16 << 20
    assert float(pool[:65536].sum()) == 65536 * 32
    for dtype in (torch.bfloat16, torch.int8):
        assert zeroed_pool((64, 2, 8), dtype).dtype == dtype


def test_engine_reports_weights_kv_and_resident_memory(tiny_model_dirs):
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams
    from sudu.server.metrics import _EngineStatsCollector

    llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, kv_cache_memory=64 << 20)
    eng = llm.engine
    pools = kv_pool_tensors(eng.runner.kv_caches)
    assert eng.memory["memory_kv_pool_bytes"] == sum(t.numel() * t.element_size() for t in pools)
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for p in list(eng.runner.model.parameters()) + list(eng.runner.model.buffers())}
    assert eng.memory["memory_weights_bytes"] == sum(params.values()) > 0
    resident_before = resident_bytes(pools)
    assert resident_before < eng.memory["memory_kv_pool_bytes"] // 4
    llm.generate([[5, 9, 13] * 40], SamplingParams(max_tokens=8, temperature=0.0))
    assert resident_bytes(pools) > resident_before  # the prompt's blocks were written
    stats = eng.stats()
    assert stats["memory_rss_bytes"] > 0
    metrics = {m.name: m.samples[0].value for m in _EngineStatsCollector(lambda: stats).collect() if m.samples}
    assert metrics["sudu:memory_kv_pool_bytes"] == eng.memory["memory_kv_pool_bytes"]
    assert metrics["sudu:memory_weights_bytes"] == eng.memory["memory_weights_bytes"]


def test_kv_prefault_commits_the_whole_pool_at_load_and_changes_no_answer(tiny_model_dirs):
    from sudu.engine.llm import LLM
    from sudu.sampling import SamplingParams

    prompt, params = [[5, 9, 13] * 40], SamplingParams(max_tokens=8, temperature=0.0)
    answers = []
    for prefault in (False, True):
        llm = LLM(str(tiny_model_dirs["qwen2"]), progress=False, kv_cache_memory=16 << 20, kv_prefault=prefault)
        pools = kv_pool_tensors(llm.engine.runner.kv_caches)
        pool_bytes = llm.engine.memory["memory_kv_pool_bytes"]
        resident = llm.engine.memory["memory_kv_resident_bytes"]
        assert (resident == pool_bytes) if prefault else (resident < pool_bytes // 4)
        assert all(not t.any() for t in pools)  # the pool is still zero
        answers.append(llm.generate(prompt, params)[0].token_ids)
    assert answers[0] == answers[1]
