"""The metric definitions of sudu bench and the code that applies them: per-request figures (TTFT, TPOT,
ITL per token, E2E, output tokens, cached tokens, sudu's timing attribution), per-run throughput (mean
and best 1-s window), goodput against SLOs, and the checks that flag a contradicted cache state or a
token-count gap. The DEFINITIONS text goes into every report."""
from __future__ import annotations

from sudu.errors import SuduError

SCHEMA = "sudu-bench/1"

DEFINITIONS = {
    "ttft_s": "Time to first token: request sent -> first chunk carrying generated content "
    "(role-only or empty chunks do not count).",
    "tpot_s": "Time per output token: (e2e - TTFT) / (output_tokens - 1), per request, excluding the first "
    "token. Per-request output speed = 1 / TPOT.",
    "itl_s": "Inter-token latency: gaps between consecutive content chunks, per token: a chunk carrying k "
    "tokens contributes k gaps of gap/k. Tokens per chunk come from the server's per-chunk info "
    "(logprobs entries, cumulative usage) if present, else the model's tokenizer, else 1.",
    "e2e_s": "End to end: request sent -> last content chunk.",
    "task_time_s": "Task time: task start -> the task's answer passes its checker, every call counted; "
    "a task that never passes has no time (a wrong answer is never a fast answer).",
    "output_tokens": "From the server's usage (stream_options.include_usage is always sent); re-counted "
    "with the model's tokenizer when sudu knows the model; a gap > 2% is reported (a stop token counted "
    "by the server but sent as no text is not a gap).",
    "throughput_tok_s": "Total output tokens / measurement window (first request sent -> last request "
    "done). Peak = best 1-s window, reported next to the mean, never instead of it.",
    "goodput_req_s": "Requests meeting every SLO / measurement window.",
    "cache_state": "Declared per workload: cold (a unique random salt at the very start of every prompt), "
    "warm (the identical prompt was sent just before), shared-prefix (a common system prompt, distinct "
    "tails). Observed cached tokens (usage.prompt_tokens_details.cached_tokens or "
    "usage.prompt_cache_hit_tokens) are recorded; contradictions are flagged.",
    "attribution": "Where the server reports a timing breakdown (sudu's `sudu` object or the "
    "Server-Timing header): request sent -> finish chunk = network/client + queue + prefill + decode, "
    "network/client being the rest.",
    "statistics": "Warm-up requests excluded; n, mean, median, p90, p99 and a seeded bootstrap 95% CI of "
    "the mean for every figure; too few samples -> no CI, said so.",
}

TOKEN_GAP_LIMIT = 0.02
COLD_CACHED_TOKENS_LIMIT = 16  # only the template's role header precedes the salt (one KV block at most)


def cached_tokens(usage: dict | None, sudu: dict | None = None) -> int | None:
    """Observed cached prompt tokens; None when the server does not report them at all."""
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            return int(details["cached_tokens"])
        if usage.get("prompt_cache_hit_tokens") is not None:
            return int(usage["prompt_cache_hit_tokens"])
    if isinstance(sudu, dict) and sudu.get("cached_tokens") is not None:
        return int(sudu["cached_tokens"])
    return None


def itl_per_token(chunk_times_s: list[float], chunk_tokens: list[int]) -> list[float]:
    gaps: list[float] = []
    for i in range(1, len(chunk_times_s)):
        k = max(1, chunk_tokens[i])
        g = (chunk_times_s[i] - chunk_times_s[i - 1]) / k
        gaps.extend([g] * k)
    return gaps


def timing_breakdown(rec) -> dict | None:
    src = rec.sudu if isinstance(rec.sudu, dict) and "prefill_s" in rec.sudu else rec.server_timing
    if not src or not rec.chunk_times_s:
        return None
    parts = {k: float(src.get(k) or 0.0) for k in ("queue_s", "prefill_s", "decode_s")}
    # the server's decode ends with the finishing step (e.g. the stop token, which carries no text), so
    # the span split here ends at the finish chunk, not at the last content chunk
    end = rec.finish_s if rec.finish_s is not None else rec.chunk_times_s[-1]
    parts["network_client_s"] = end - sum(parts.values())
    return parts


def request_metrics(rec) -> dict:
    """Per-request figures; stored in the record so that reports and `compare` read the same numbers."""
    m: dict = {"ok": rec.ok}
    usage = rec.usage or {}
    m["prompt_tokens"] = usage.get("prompt_tokens")
    m["cached_tokens"] = cached_tokens(rec.usage, rec.sudu)
    if not rec.chunk_times_s:
        return m
    ttft = rec.chunk_times_s[0]
    e2e = rec.chunk_times_s[-1]
    chunk_sum = sum(rec.chunk_tokens)
    if isinstance(usage.get("completion_tokens"), int):
        out, source = usage["completion_tokens"], "usage"
    else:
        out, source = chunk_sum, "chunks:" + rec.token_source
    m.update(ttft_s=ttft, e2e_s=e2e, output_tokens=out, output_tokens_source=source, chunk_tokens=chunk_sum)
    if out > 1 and e2e > ttft:
        m["tpot_s"] = (e2e - ttft) / (out - 1)
        m["output_speed_tok_s"] = 1.0 / m["tpot_s"]
    m["itl_s"] = itl_per_token(rec.chunk_times_s, rec.chunk_tokens)
    breakdown = timing_breakdown(rec)
    if breakdown:
        m["attribution"] = breakdown
    if isinstance(rec.sudu, dict):
        for key in ("acceptance_rate", "mean_accepted_len"):
            if rec.sudu.get(key) is not None:
                m[key] = float(rec.sudu[key])
    return m


def measured(records) -> list:
    return [r for r in records if not r.warmup]


def throughput(records) -> dict:
    """Output tokens over the measurement window; peak over the best 1-s window. Each chunk's tokens are
    scaled so that a request's total equals its reported output tokens."""
    recs = [r for r in measured(records) if r.chunk_times_s]
    if not recs:
        return {"n_requests": 0}
    start = min(r.t_sent_s for r in measured(records))
    end = max(r.t_sent_s + (r.done_s if r.done_s is not None else r.chunk_times_s[-1]) for r in recs)
    window = max(end - start, 1e-9)
    events: list[tuple[float, float]] = []
    total = 0
    for r in recs:
        out = r.metrics.get("output_tokens") or sum(r.chunk_tokens)
        scale = out / max(1, sum(r.chunk_tokens))
        total += out
        events.extend((r.t_sent_s - start + t, k * scale) for t, k in zip(r.chunk_times_s, r.chunk_tokens))
    events.sort()
    res = {
        "n_requests": len(recs),
        "window_s": window,
        "output_tokens": total,
        "mean_tok_s": total / window,
        "requests_per_s": len(recs) / window,
    }
    if window >= 1.0:
        best, acc, lo = 0.0, 0.0, 0
        for t, w in events:
            acc += w
            while events[lo][0] <= t - 1.0:
                acc -= events[lo][1]
                lo += 1
            best = max(best, acc)
        res["peak_tok_s"] = best
        nbins = int(window)
        bins = [0.0] * nbins
        for t, w in events:
            i = int(t)
            if i < nbins:
                bins[i] += w
        res["per_second_tok"] = bins
    else:
        res["peak_tok_s"] = None
        res["peak_note"] = "window shorter than 1 s: no peak"
    return res


def parse_slo(text: str | None) -> dict:
    """`ttft=500ms,tpot=50ms,e2e=10s` -> {"ttft_s": 0.5, "tpot_s": 0.05, "e2e_s": 10.0} (bare numbers: s)."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        if "=" not in part:
            raise SuduError(f"bad --slo entry {part!r}: expected name=value, e.g. ttft=500ms")
        name, value = (x.strip().lower() for x in part.split("=", 1))
        if name not in ("ttft", "tpot", "itl", "e2e"):
            raise SuduError(f"unknown SLO {name!r}: use ttft, tpot, itl or e2e")
        scale = 1.0
        if value.endswith("ms"):
            value, scale = value[:-2], 1e-3
        elif value.endswith("s"):
            value = value[:-1]
        try:
            out[f"{name}_s"] = float(value) * scale
        except ValueError:
            raise SuduError(f"bad --slo value for {name}: {value!r}") from None
    return out


def meets_slo(m: dict, slo: dict) -> bool:
    if not m.get("ok"):
        return False
    for key, limit in slo.items():
        if key == "itl_s":
            itl = m.get("itl_s") or []
            if itl and max(itl) > limit:
                return False
            continue
        value = m.get(key)
        if value is not None and value > limit:
            return False
    return True


def goodput(records, slo: dict, window_s: float) -> dict | None:
    if not slo:
        return None
    recs = measured(records)
    good = sum(1 for r in recs if meets_slo(r.metrics, slo))
    return {
        "slo": slo,
        "good_requests": good,
        "total_requests": len(recs),
        "fraction": good / len(recs) if recs else None,
        "goodput_req_s": good / window_s if window_s else None,
    }


def cache_flags(records, cold_limit: int = COLD_CACHED_TOKENS_LIMIT) -> list[str]:
    """Contradictions between a declared cache state and the cached tokens the server reported."""
    flags = []
    for r in measured(records):
        c = r.metrics.get("cached_tokens")
        if c is None:
            continue
        if r.cache_state == "cold" and c > cold_limit:
            flags.append(f"request {r.request_id} ({r.group}): declared cold but {c} cached tokens (> {cold_limit})")
        if r.cache_state == "warm" and c == 0:
            flags.append(f"request {r.request_id} ({r.group}): declared warm but 0 cached tokens")
    return flags


def observed_cache(records) -> dict:
    values = [r.metrics.get("cached_tokens") for r in measured(records)]
    reported = [v for v in values if v is not None]
    return {
        "reported": bool(reported),
        "requests_reporting": len(reported),
        "mean_cached_tokens": sum(reported) / len(reported) if reported else None,
    }


def token_gap(out: int, recount: int, finish_reason: str | None) -> float:
    """Relative gap between the server's and the tokenizer's counts. A server may count the stop token
    it generated but never sent as text (finish_reason "stop"): one extra token is not a gap."""
    gap = abs(recount - out) / out
    if finish_reason == "stop":
        gap = min(gap, abs(recount + 1 - out) / out)
    return gap


def token_gap_flags(records) -> list[str]:
    flags = []
    for r in measured(records):
        recount = r.metrics.get("output_tokens_recounted")
        out = r.metrics.get("output_tokens")
        if recount is None or not out:
            continue
        gap = token_gap(out, recount, r.finish_reason)
        if gap > TOKEN_GAP_LIMIT:
            flags.append(
                f"request {r.request_id} ({r.group}): server says {out} output tokens, tokenizer counts {recount} "
                f"({gap:.1%} > {TOKEN_GAP_LIMIT:.0%})"
            )
    return flags
