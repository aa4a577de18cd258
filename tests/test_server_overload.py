"""The short version of benchmarks/overload.py: open-loop Poisson arrivals far above what a small
engine (2 running sequences, 2 queued) can hold. Every request must end with a complete answer or a
429 carrying Retry-After: no other error, nothing lost, and every KV block back in the pool after."""
from __future__ import annotations

import asyncio
import time

from benchmarks.overload import open_loop
from sudu.config import EngineConfig
from sudu.server.app import build_app
from tests.helpers.live_server import LiveServer


def test_overload_is_answered_with_429_and_nothing_is_lost(tiny_model_dirs):
    from sudu.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(tiny_model_dirs["llama"]), max_model_len=256, max_num_seqs=2,
                          kv_cache_memory=8 << 20)
    engine = AsyncLLMEngine(config, max_queue_len=2)
    with LiveServer(build_app(engine)) as live:
        # 150/s: several times what the tiny engine completes (40/s came within its reach once its decode
        # got faster, and then nothing had to be refused)
        result = asyncio.run(open_loop(live.url, rate_per_s=150, duration_s=1.0, max_tokens=16, timeout_s=120))
        assert [o for o in result.outcomes if o.kind in ("error", "lost")] == []
        assert result.count("ok") >= 1 and result.count("rejected") >= 1
        assert all(o.status == 429 and int(o.retry_after) >= 1 for o in result.outcomes if o.kind == "rejected")
        assert all(o.ttft_s is not None for o in result.outcomes if o.kind == "ok")
        deadline = time.monotonic() + 20
        stats = engine.stats()
        while stats["num_free_blocks"] != stats["num_total_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
