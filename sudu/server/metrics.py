"""Prometheus metrics of one server (its own registry, so several apps in one process never collide).
Names mirror vLLM's `vllm:` metrics under `sudu:`. Per-request histograms and token counters are fed by
the routes as outputs stream out; engine-wide state (running/waiting requests, KV usage, the context
cache's counters per tier) is read from `engine.stats()` at scrape time."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineStatsCollector(Collector):
    """Gauges and cumulative prefix-cache counters straight from engine.stats() (nothing before load)."""

    def __init__(self, get_stats: Callable[[], dict | None]):
        self._get_stats = get_stats

    def collect(self):
        stats = self._get_stats()
        if stats is None:
            return
        for name, key, doc in (
            ("sudu:num_requests_running", "num_running", "Requests in the running batch."),
            ("sudu:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
            ("sudu:kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0..1)."),
            ("sudu:memory_weights_bytes", "memory_weights_bytes", "Bytes of the model's weights as loaded."),
            ("sudu:memory_weights_huge_page_bytes", "memory_weights_huge_page_bytes",
             "Bytes of the weights that the OS backs with transparent huge pages."),
            ("sudu:memory_kv_pool_bytes", "memory_kv_pool_bytes",
             "Bytes of the KV pools as allocated (their pages are committed as they fill)."),
            ("sudu:memory_rss_bytes", "memory_rss_bytes", "Resident set of the engine's process."),
            ("sudu:memory_kv_resident_bytes", "memory_kv_resident_bytes",
             "Bytes of the KV pools resident now (they commit pages as the prefix cache fills them)."),
            ("sudu:admission_in_transit", "admission_in_transit",
             "Requests admitted and not yet in the engine's queue (they count in the next predictions)."),
            ("sudu:admission_promised", "admission_promised",
             "Refused requests whose place is kept for their return after Retry-After."),
            ("sudu:admission_prefill_seconds_per_token", "admission_prefill_s_per_token",
             "Measured seconds per prompt token (moving average; 0 until measured)."),
            ("sudu:admission_decode_step_seconds", "admission_decode_step_s",
             "Measured seconds per decode step (moving average; 0 until measured)."),
            ("sudu:admission_turn_seconds", "admission_turn_s",
             "Measured seconds per first token while the engine runs at capacity: the pace of the promised turns "
             "(moving average; 0 until measured)."),
            ("sudu:admission_calibration", "admission_calibration",
             "The 90th percentile of recent requests' actual over predicted wait (predictions are scaled by it)."),
            ("sudu:admission_promises_kept", "admission_promises_kept",
             "Refused requests that came back after their Retry-After while their place was kept."),
            ("sudu:admission_promises_expired", "admission_promises_expired",
             "Refused requests that did not come back while their place was kept."),
            ("sudu:admission_show_rate", "admission_show_rate",
             "Moving share of refused requests that come back: the share of promised work counted ahead."),
        ):
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for name, key, doc in (
            ("sudu:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("sudu:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            ("sudu:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Speculative tokens proposed."),
            ("sudu:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Speculative tokens accepted."),
            ("sudu:encoder_cache_hits", "encoder_cache_hits", "Images whose embeddings the encoder cache held."),
            ("sudu:encoder_cache_misses", "encoder_cache_misses", "Images the vision tower encoded."),
            ("sudu:encoder_seconds", "encoder_seconds", "Seconds spent in the vision tower."),
        ):
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
        yield GaugeMetricFamily("sudu:encoder_cache_bytes", "Bytes of image embeddings in the encoder cache.",
                                value=float(stats.get("encoder_cache_bytes", 0)))
        yield from _context_cache_metrics(stats)


def _context_cache_metrics(stats: dict):
    """The context cache per tier: prompt tokens hit and missed in RAM and on disk, and the disk tier's
    traffic and upkeep (cache/disk_store.py)."""
    queries, hits, disk_hits = (float(stats.get(k, 0)) for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                                   "prefix_cache_hits_disk"))
    tiers = [("ram", hits - disk_hits, queries - (hits - disk_hits))]
    if stats.get("disk_cache_enabled"):
        tiers.append(("disk", disk_hits, queries - hits))  # looked up on disk: whatever RAM missed
    hit = CounterMetricFamily("sudu:prefix_cache_tier_hits", "Prompt tokens found, by cache tier.", labels=["tier"])
    miss = CounterMetricFamily("sudu:prefix_cache_tier_misses", "Prompt tokens a tier was asked for and did not hold.",
                               labels=["tier"])
    for tier, h, m in tiers:
        hit.add_metric([tier], h)
        miss.add_metric([tier], m)
    yield hit
    yield miss
    for name, key, doc in (
        ("sudu:disk_cache_enabled", "disk_cache_enabled", "1 when the context cache has its disk tier."),
        ("sudu:disk_cache_bytes", "disk_cache_bytes", "Bytes of KV block files in the disk tier's directory."),
        ("sudu:disk_cache_blocks", "disk_cache_blocks", "KV block files in the disk tier's directory."),
    ):
        yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
    for name, key, doc in (
        ("sudu:disk_cache_block_hits", "disk_cache_hits", "KV blocks loaded from disk."),
        ("sudu:disk_cache_block_misses", "disk_cache_misses", "Disk lookups that found no usable file."),
        ("sudu:disk_cache_read_bytes", "disk_cache_bytes_read", "Bytes read from the disk tier."),
        ("sudu:disk_cache_read_seconds", "disk_cache_read_s", "Seconds spent reading and checking block files."),
        ("sudu:disk_cache_written_blocks", "disk_cache_blocks_written", "KV blocks written to disk."),
        ("sudu:disk_cache_written_bytes", "disk_cache_bytes_written", "Bytes written to the disk tier."),
        ("sudu:disk_cache_write_seconds", "disk_cache_write_s", "Seconds the writer thread spent writing."),
        ("sudu:disk_cache_writes_dropped", "disk_cache_writes_dropped", "Blocks not written: the writer was behind."),
        ("sudu:disk_cache_write_errors", "disk_cache_write_errors", "Block writes that failed (full or broken disk)."),
        ("sudu:disk_cache_evictions", "disk_cache_evictions", "Block files removed to stay within the size budget."),
        ("sudu:disk_cache_corrupt_dropped", "disk_cache_corrupt_dropped",
         "Block files that failed a check (truncated, corrupt, foreign) and were deleted."),
    ):
        yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))


class ServerMetrics:
    def __init__(self, get_stats: Callable[[], dict | None]):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.time_to_first_token = Histogram(
            "sudu:time_to_first_token_seconds", "Request received -> first generated token.",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.inter_token_latency = Histogram(
            "sudu:inter_token_latency_seconds", "Gap between consecutive token-carrying outputs of a request.",
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e_request_latency = Histogram(
            "sudu:e2e_request_latency_seconds", "Request received -> last token.", buckets=_REQUEST_BUCKETS, registry=r
        )
        self.request_queue_time = Histogram(
            "sudu:request_queue_time_seconds", "Engine arrival -> first scheduled.", buckets=_REQUEST_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("sudu:prompt_tokens", "Prompt tokens of started requests.", registry=r)
        self.generation_tokens = Counter("sudu:generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter(
            "sudu:request_success", "Finished choices, by finish reason.", ["finish_reason"], registry=r
        )
        self.request_errors = Counter(
            "sudu:request_errors", "Requests answered with an error (a stream: an error event), by status and code.",
            ["status", "code"], registry=r,
        )
        self.admission_admitted = Counter(
            "sudu:admission_admitted", "Calls admitted by predicted wait (server/admission.py).", registry=r)
        self.admission_refused = Counter(
            "sudu:admission_refused", "Calls refused with 429: predicted wait over --max-queue-wait.", registry=r)
        self.predicted_wait = Histogram(
            "sudu:admission_predicted_wait_seconds", "Predicted engine wait to the first token, admitted requests.",
            buckets=_TTFT_BUCKETS, registry=r)
        self.actual_wait = Histogram(
            "sudu:admission_actual_wait_seconds", "Engine arrival -> first token (the wait that was predicted).",
            buckets=_TTFT_BUCKETS, registry=r)
        r.register(_EngineStatsCollector(get_stats))

    def count_error(self, err) -> None:
        """An error answered to a client (server/errors.APIError)."""
        self.request_errors.labels(status=str(err.status), code=err.code or "").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
