"""EngineReplica: the Ray Serve deployment class, one AsyncLLMEngine per replica.

`generate` streams the engine's RequestOutputs back through the DeploymentHandle (a cancelled call
aborts the engine request, so its KV blocks return to the pool). `record_routing_stats` is Serve's
routing-stats hook: the replica's cache summary for the router (cache_view.py) and its engine stats
for the ingress's /metrics. `check_health` fails once the engine cannot continue, and Serve replaces
the replica."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import AsyncIterator

from ray import serve

from sudu.cluster.cache_view import summarize
from sudu.cluster.handoff import (Handoff, check_handoff_supported, export_prompt_blocks, handoff_route,
                                  import_prompt_blocks)
from sudu.cluster.passing_thread import in_passing_thread
from sudu.config import EngineConfig
from sudu.engine.outputs import RequestOutput
from sudu.engine.request import CheckedRequest


class EngineReplica:
    def __init__(self, config: EngineConfig, max_queue_len: int, stall_timeout_s: float):
        from sudu.engine.async_engine import AsyncLLMEngine

        # loaded in a thread that ends with the load, so the engine thread's OpenMP team is the only one
        self.engine = in_passing_thread(lambda: AsyncLLMEngine(config, max_queue_len=max_queue_len, progress=False,
                                                               stall_timeout_s=stall_timeout_s))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._start_lock = asyncio.Lock()
        self._started = False
        self._summary: tuple[frozenset, int, bytes] = (frozenset(), 0, summarize(()))

    async def _ensure_started(self) -> None:
        async with self._start_lock:
            if not self._started:
                await self.engine.start()
                self._started = True

    def describe(self) -> dict:
        """What the ingress needs to admit requests as the engine would (see engine.py)."""
        eng = self.engine.engine
        return {"model_name": self.engine.model_name, "max_model_len": eng.max_model_len,
                "vocab_size": eng.model_config.vocab_size, "pool_tokens": eng.runner.num_blocks * eng.config.block_size,
                "tokenizer": eng.tokenizer, "eos_token_ids": sorted(eng.eos_token_ids),
                "niceness": os.nice(0)}

    async def generate(self, request_id: str, request: CheckedRequest, priority: int = 0, handoff=None
                       ) -> AsyncIterator[RequestOutput]:
        """handoff: a prefill replica's Handoff (--pd; Serve resolves the prefill call's result here, out
        of Ray's object store): its blocks enter this engine's prefix cache before the request does."""
        await self._ensure_started()
        route = None
        if handoff is not None:
            received = time.time()
            t0 = time.perf_counter()
            imported = await self.engine.run_in_engine(
                lambda eng: import_prompt_blocks(eng, request.prompt_token_ids, handoff.payload, handoff.namespace))
            route = handoff_route(handoff, imported, time.perf_counter() - t0, received)
        async for out in self.engine.generate(request_id, request, priority):
            # the prompt goes back to the ingress with every output otherwise; the ingress has it (engine.py)
            yield out.routed(route, prompt_token_ids=[])

    def check_handoff(self) -> None:
        check_handoff_supported(self.engine.engine)

    async def prefill(self, request_id: str, request: CheckedRequest, priority: int = 0) -> Handoff:
        """--pd's prefill side: the prompt run for one token, then its blocks copied out of the pool."""
        await self._ensure_started()
        start = time.perf_counter()
        one = dataclasses.replace(request, max_tokens=1,
                                  params=dataclasses.replace(request.params, max_tokens=1, n=1, logprobs=None, grammar=None))
        async for _ in self.engine.generate(f"{request_id}-prefill", one, priority):
            pass
        prefill_s = time.perf_counter() - start
        t0 = time.perf_counter()
        payload = await self.engine.run_in_engine(lambda eng: export_prompt_blocks(eng, request.prompt_token_ids))
        return Handoff(payload, self.replica_id, prefill_s, time.perf_counter() - t0, time.time(),
                       self.engine.engine.block_manager.namespace)

    def record_routing_stats(self) -> dict:
        ids = frozenset(self.engine.engine.block_manager.cached_block_ids())
        seen, version, summary = self._summary
        if ids != seen:
            self._summary = seen, version, summary = ids, version + 1, summarize(ids)
        bm = self.engine.engine.block_manager
        return {"cache_version": version, "cache_ids": summary, "namespace": bm.namespace.hex(),
                "block_size": bm.block_size, "stats": self.engine.stats()}

    def check_health(self) -> None:
        if self.engine.failure is not None:
            raise RuntimeError(f"the engine failed: {self.engine.failure}")
