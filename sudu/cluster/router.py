"""CacheAwareRouter: a Ray Serve request router (serve.request_router.RequestRouter) for the engine
replicas. It runs in the process that holds the DeploymentHandle, the ingress.

For each request it hashes the prompt's full blocks with the replicas' namespace (the same stable ids
the engines use), predicts each replica's prefix hit from its reported cache summary (cache_view.py)
and ranks the replicas: the longest hit first, unless the load guard sends the request to the least
loaded replica. Load is the requests this router has in flight on each replica (its own routed /
completed hooks), so it is exact for a single ingress. Serve then sends to the first rank with room
and moves on to the next rank if that replica is full.

Replicas report their summary through `record_routing_stats` (Serve's routing-stats channel: the
controller polls each replica every `request_routing_stats_period_s` and hands the result to every
handle), so evictions reach the router with the next report.

The ingress reads what the router decided (the replica and its predicted hit, for the response) and
the replicas' engine stats from the live instance, which registers itself in registry.py.

`policy="round_robin"` ignores caches: the baseline routing is compared against.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from sudu.cluster import registry
from sudu.cluster.cache_view import ReplicaCache, choose, prompt_block_ids


_MAX_DECISIONS = 4096  # decisions not collected by the ingress (a request cancelled early) are dropped past this


class CacheAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "cache_aware", imbalance_threshold: int = 4,
                         pending_ttl_s: float = 30.0, **_: Any) -> None:
        if policy not in ("cache_aware", "round_robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.imbalance_threshold = imbalance_threshold
        self.pending_ttl_s = pending_ttl_s
        self.caches: dict[str, ReplicaCache] = {}
        self.in_flight: dict[str, set[str]] = {}  # replica -> internal request ids
        self.decisions: OrderedDict[str, dict] = OrderedDict()  # sudu request id -> route
        self._predicted: dict[str, tuple[list[int], dict[str, int], str]] = {}  # internal id -> (ids, hits, reason)
        self._rr = itertools.count()
        self.route_counts: Counter[str] = Counter()  # requests routed, by reason
        registry.register(self._deployment_id.app_name, self)

    # ---- what replicas report --------------------------------------------------------------------
    def replica_stats(self) -> dict[str, dict]:
        """Each running replica's last report: engine stats, namespace, summary version."""
        return {r.replica_id.unique_id: dict(r.routing_stats) for r in self._replicas_list}

    def _refresh(self, replicas: list[RunningReplica]) -> None:
        now = time.monotonic()
        for r in replicas:
            key = r.replica_id.unique_id
            stats = r.routing_stats or {}
            cache = self.caches.setdefault(key, ReplicaCache())
            if "cache_version" in stats:
                cache.update(stats["cache_version"], stats["cache_ids"])
            cache.expire(now, self.pending_ttl_s)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for key in [k for k in self.caches if k not in live]:  # a dead replica's cache died with it
            del self.caches[key]

    # ---- the choice ------------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {k: len(self.in_flight.get(k, ())) for k in by_key}
        request = _engine_request(pending_request)
        if self.policy == "round_robin" or request is None:
            keys = sorted(by_key)
            start = next(self._rr) % len(keys)
            order = keys[start:] + keys[:start]
            self._note(pending_request, [], dict.fromkeys(by_key, 0), "round_robin")
            return [[by_key[k]] for k in order]
        self._refresh(candidate_replicas)
        ids = self._prompt_ids(pending_request, candidate_replicas, request)
        choice = choose(ids, self.caches, loads, self.imbalance_threshold, tie_break=next(self._rr))
        self._note(pending_request, ids, choice.predicted_blocks, choice.reason)
        return [[by_key[k]] for k in choice.order]

    def _prompt_ids(self, pending_request: PendingRequest, replicas: list[RunningReplica], request) -> list[int]:
        internal = pending_request.metadata.internal_request_id
        if internal in self._predicted:  # chosen again after a backoff: hashed already
            return self._predicted[internal][0]
        for r in replicas:
            stats = r.routing_stats or {}
            if "namespace" in stats:
                return prompt_block_ids(bytes.fromhex(stats["namespace"]), request.prompt_token_ids,
                                        stats["block_size"])
        return []  # no replica has reported yet: nothing to predict from

    def _note(self, pending_request: PendingRequest | None, ids: list[int], predicted: dict[str, int],
              reason: str) -> None:
        if pending_request is not None:
            self._predicted[pending_request.metadata.internal_request_id] = (ids, predicted, reason)

    # ---- Serve's hooks -----------------------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        internal = pending_request.metadata.internal_request_id
        key = replica_id.unique_id
        self.in_flight.setdefault(key, set()).add(internal)
        ids, predicted, reason = self._predicted.pop(internal, ([], {}, "round_robin"))
        self.route_counts[reason] += 1
        if ids:
            self.caches.setdefault(key, ReplicaCache()).add_pending(ids, time.monotonic())
        request_id = pending_request.kwargs.get("request_id")
        if request_id is not None:
            block_size = self._block_size()
            self.decisions[request_id] = {"replica": key, "route": reason,
                                          "predicted_cached_tokens": predicted.get(key, 0) * block_size}
            while len(self.decisions) > _MAX_DECISIONS:
                self.decisions.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.get(replica_id.unique_id, set()).discard(internal_request_id)
        self._predicted.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.caches.pop(replica_id.unique_id, None)
        self.in_flight.pop(replica_id.unique_id, None)

    def _block_size(self) -> int:
        for r in self._replicas_list:
            if "block_size" in (r.routing_stats or {}):
                return r.routing_stats["block_size"]
        return 0

    def take_decision(self, request_id: str) -> dict | None:
        return self.decisions.pop(request_id, None)


def _engine_request(pending_request: PendingRequest | None):
    """The CheckedRequest a `generate` call carries (keyword `request`), else None."""
    if pending_request is None:
        return None
    request = pending_request.kwargs.get("request")
    return request if hasattr(request, "prompt_token_ids") else None
