"""Per-replica series on the ingress's /metrics, next to the app's own (which sum the replicas): each
replica's last report to the router, labelled by replica id, and the router's decisions by reason."""
from __future__ import annotations

from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_GAUGES = (
    ("sudu:replica_num_requests_running", "num_running", "Requests in a replica's running batch."),
    ("sudu:replica_num_requests_waiting", "num_waiting", "Requests waiting in a replica's engine."),
    ("sudu:replica_kv_cache_usage_perc", "kv_cache_usage", "Fraction of a replica's KV blocks in use (0..1)."),
)
_COUNTERS = (
    ("sudu:replica_prefix_cache_queries", "prefix_cache_queries", "Prompt tokens a replica looked up in its cache."),
    ("sudu:replica_prefix_cache_hits", "prefix_cache_hits", "Prompt tokens a replica found in its cache."),
)


class ReplicaCollector(Collector):
    def __init__(self, get_engine: Callable[[], object | None]):
        self._get_engine = get_engine

    def collect(self):
        engine = self._get_engine()
        if engine is None:
            return
        reports = {replica: r.get("stats", {}) for replica, r in engine.replica_stats().items()}
        for name, key, doc in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica, stats in reports.items():
                family.add_metric([replica], float(stats.get(key, 0)))
            yield family
        for name, key, doc in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["replica"])
            for replica, stats in reports.items():
                family.add_metric([replica], float(stats.get(key, 0)))
            yield family
        routes = CounterMetricFamily("sudu:route_decisions", "Requests routed, by the reason for the replica "
                                     "chosen (prefix, least_loaded, load_guard, round_robin).", labels=["route"])
        for reason, n in engine.route_counts().items():
            routes.add_metric([reason], float(n))
        yield routes
