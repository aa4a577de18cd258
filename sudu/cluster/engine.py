"""ClusterEngine: the server's engine interface (server/engine_protocol.py) over the replicas'
DeploymentHandle, so the ingress is sudu's own OpenAI app, unchanged.

Admission happens here as in one engine: the tokenizer and the limits come from a replica once
(`describe`), and `check_request` is LLMEngine's own check run over those limits. `generate` calls the
replica chosen by the router (router.py) and streams its outputs, each carrying the route
(`RequestOutput.route`: the replica and the predicted hit, for the `sudu` extension and a header).
A replica lost mid-request ends that request with 503 `replica_failed` (retryable): Serve restarts the
replica, the others are not touched. `stats()` sums the replicas' last reports for /metrics;
`replicas()` is the deployment's state for /health."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import AsyncIterator

import ray
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from sudu.cluster.registry import PREFILL_APP_NAME, router_for
from sudu.engine.llm_engine import LLMEngine
from sudu.structured.backend import GrammarBackend
from sudu.engine.outputs import RequestOutput
from sudu.engine.request import CheckedRequest
from sudu.sampling import SamplingParams
from sudu.server.errors import RETRY_AFTER_S, APIError, queue_full

log = logging.getLogger(__name__)

# engine stats that are averaged over replicas rather than summed
_MEAN_STATS = ("kv_cache_usage",)


def replica_failed(detail: str) -> APIError:
    return APIError(503, f"The replica serving this request failed ({detail}); it is being restarted, retry the "
                         "request", type="service_unavailable", code="replica_failed",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class _Limits:
    """The fields of an LLMEngine that its check_request reads, fixed at load."""

    def __init__(self, info: dict, block_size: int):
        self.model_config = SimpleNamespace(vocab_size=info["vocab_size"])
        self.max_model_len = info["max_model_len"]
        self.runner = SimpleNamespace(num_blocks=info["pool_tokens"] // block_size)
        self.config = SimpleNamespace(block_size=block_size)
        # structured output: grammars are compiled here too, so a bad one is a 400 before routing
        self.grammar_backend = GrammarBackend(info["tokenizer"], info["vocab_size"], info["eos_token_ids"])

    resolve_max_tokens = LLMEngine.resolve_max_tokens
    check_request = LLMEngine.check_request


class ClusterEngine:
    def __init__(self, app_name: str, deployment: str, info: dict, block_size: int, num_replicas: int,
                 max_in_flight: int, prefill_app: str | None = None, num_prefill: int = 0):
        """prefill_app: the prefill replicas' application under --pd (app_name's replicas then decode only)."""
        self.app_name = app_name
        self.deployment = deployment
        self.prefill_app = prefill_app
        self.handle = self.prefill = None  # made in start(), in the server's event loop
        self.num_prefill = num_prefill
        self.model_name = info["model_name"]
        self.max_model_len = info["max_model_len"]
        self.tokenizer = info["tokenizer"]
        self.num_replicas = num_replicas
        self.max_in_flight = max_in_flight
        self._limits = _Limits(info, block_size)
        self.grammar_backend = self._limits.grammar_backend
        self._calls: dict[str, object] = {}
        self._failed = asyncio.Event()
        self._accepting = True

    async def start(self) -> None:
        """The request path's handles, made and initialised here, in the server's event loop: under Serve's
        throughput mode their routers run on this loop. Under --pd the decode call takes the prefill
        call's result as an object reference (Ray's object store carries the blocks), so both handles pass
        arguments by reference; otherwise calls go by value (gRPC where Serve's mode enables it), pickled
        with the standard library's pickle: sudu's requests and outputs are importable dataclasses, which
        cloudpickle (Serve's default) pickles slower (docs/cluster.md)."""
        call_options = ({"_by_reference": True} if self.prefill_app else
                        {"request_serialization": "pickle", "response_serialization": "pickle"})
        self.handle = self._request_handle(self.app_name, stream=True, **call_options)
        if self.prefill_app:
            self.prefill = self._request_handle(self.prefill_app, **call_options)

    def _request_handle(self, app_name: str, **options):
        """A handle of its own (not Serve's cached one, which the loading thread initialised), initialised
        in the running loop, with these call options."""
        handle = DeploymentHandle(self.deployment, app_name)
        handle._init()
        return handle.options(**options)

    async def wait_failed(self) -> str:
        """Replicas that die are restarted by Serve and fail only their own requests: the ingress as a
        whole does not fail."""
        await self._failed.wait()
        return "unreachable"

    async def shutdown(self, timeout_s: float) -> None:
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._calls and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for call in list(self._calls.values()):
            call.cancel()

    def is_full(self) -> bool:
        return len(self._calls) >= self.max_in_flight

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> CheckedRequest:
        return self._limits.check_request(prompt_token_ids, params)

    async def generate(self, request_id: str, request: CheckedRequest, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        if not self._accepting:
            raise RuntimeError("the server is shutting down")
        handoff = None
        if self.prefill is not None:  # --pd: Serve hands the prefill call's result (an object ref) to the decoder
            handoff = self.prefill.prefill.remote(request_id=request_id, request=request, priority=priority)
        call = self.handle.generate.remote(request_id=request_id, request=request, priority=priority,
                                           handoff=handoff)
        self._calls[request_id] = call
        finished = False
        route = None
        try:
            async for out in call:
                if route is None:
                    route = self._take_route(request_id)
                # the replica sends its outputs without the prompt (replica.py)
                out = out.routed(route, prompt_token_ids=request.prompt_token_ids)
                finished = out.finished
                yield out
        except BackPressureError:
            raise queue_full("Every replica's queue is full") from None
        except ray.exceptions.RayError as exc:
            if isinstance(exc, ray.exceptions.TaskCancelledError) or finished:
                raise
            raise replica_failed(type(exc).__name__) from exc
        finally:
            self._calls.pop(request_id, None)
            if not finished:
                call.cancel()  # the replica's generator is cancelled, which aborts the engine request
                if handoff is not None:
                    handoff.cancel()

    def _take_route(self, request_id: str) -> dict:
        router = router_for(self.app_name)
        return (router.take_decision(request_id) if router is not None else None) or {}

    async def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            call.cancel()

    def replica_stats(self) -> dict[str, dict]:
        router = router_for(self.app_name)
        return router.replica_stats() if router is not None else {}

    def route_counts(self) -> dict[str, int]:
        router = router_for(self.app_name)
        return dict(router.route_counts) if router is not None else {}

    def stats(self) -> dict:
        """The replicas' engine stats as last reported: counters and gauges summed, usage averaged."""
        reports = [r["stats"] for r in self.replica_stats().values() if "stats" in r]
        total: dict = {}
        for stats in reports:
            for key, value in stats.items():
                if isinstance(value, (int, float)):
                    total[key] = total.get(key, 0) + value
        for key in _MEAN_STATS:
            if key in total:
                total[key] /= len(reports)
        return total

    def replicas(self) -> dict:
        """Running and target replicas of the deployment (Serve's controller view)."""
        apps = serve.status().applications
        running = 0
        for name in (self.app_name, PREFILL_APP_NAME) if self.prefill is not None else (self.app_name,):
            app = apps.get(name)
            if app is not None:
                for deployment in app.deployments.values():
                    running += deployment.replica_states.get("RUNNING", 0)
        return {"running": running, "target": self.num_replicas + self.num_prefill}
