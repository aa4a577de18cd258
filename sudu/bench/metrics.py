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
    "tpot_s": "Time per output token: (e2e - TTFT) / (tokens in the content chunks - tokens of the first "
    "content chunk), per request: the tokens that arrived after the first chunk over the time they took. "
    "Per-request output speed = 1 / TPOT.",
    "itl_s": "Inter-token latency: gaps between consecutive content chunks, per token: a chunk carrying k "
    "tokens contributes k gaps of gap/k. Tokens per chunk: the server's per-chunk counts (continuous usage "
    "stats, logprobs entries) when it sends them; else usage's total apportioned over the chunks by their "
    "texts' token counts (characters without a tokenizer), so the sum equals usage; each record says which.",
    "reasoning": "Reasoning output is timed apart: time to first reasoning token = request sent -> first chunk "
    "carrying reasoning (chat `reasoning_content` deltas, Messages `thinking` blocks, Responses reasoning items); "
    "time to first answer token = request sent -> first chunk carrying answer text or a tool call. TTFT is the "
    "earlier of the two: the first generated token of any kind.",
    "e2e_s": "End to end: request sent -> last content chunk.",
    "task_time_s": "Task time: task start -> the task's answer passes its checker, every call counted; "
    "a task that never passes has no time (a wrong answer is never a fast answer).",
    "output_tokens": "From the server's usage (stream_options.include_usage is always sent); re-counted "
    "with the model's tokenizer when sudu knows the model; a gap > 2% is reported (a stop token counted "
    "by the server but sent as no text is not a gap).",
    "throughput_tok_s": "Output tokens of completed requests / measurement window (first request sent -> "
    "last request done); tokens of streams that failed partway are counted apart. Peak = best 1-s window, "
    "reported next to the mean, never instead of it.",
    "goodput_req_s": "Requests meeting every SLO / measurement window.",
    "cache_state": "Declared per workload: cold (a unique random salt at the very start of every prompt), "
    "warm (the identical prompt was sent just before), shared-prefix (a common system prompt, distinct "
    "tails); for requests carrying an image (multimodal suite): cold (a fresh image each request and a fresh "
    "salt), warm (the identical request with the same image was sent just before), shared-image (the same image "
    "was sent just before behind another salt: only an encoder cache can reuse it). Observed cached tokens (usage.prompt_tokens_details.cached_tokens or "
    "usage.prompt_cache_hit_tokens) are recorded; contradictions are flagged.",
    "image_ttft_s": "Image-to-first-token: the TTFT of a request carrying an image (its upload, decoding, "
    "preprocessing, the vision encoder, the prompt and the first token); image tokens = median prompt tokens of "
    "the cold image requests - those of the same question without the image; image cost = median cold "
    "image-to-first-token - median TTFT of that text-only question.",
    "attribution": "Where the server reports a timing breakdown (sudu's `sudu` object or the "
    "Server-Timing header): request sent -> finish chunk = network/client + queue + prefill + decode, "
    "network/client being the rest.",
    "statistics": "Warm-up requests excluded; n, mean, median, p90, p99 and a seeded bootstrap 95% CI of "
    "the mean for every figure, resampling what is independent: requests for per-request figures and for "
    "ITL (all of a request's gaps together), contiguous time blocks for per-second throughput; too few "
    "samples -> no CI, said so.",
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


def observed_state(cached: int | None, cold_limit: int = COLD_CACHED_TOKENS_LIMIT) -> str:
    """What the server's cached-token count says happened: cold, reused (a prefix was served from a
    cache), or not reported."""
    if cached is None:
        return "not reported"
    return "cold" if cached <= cold_limit else "reused"


def itl_per_token(chunk_times_s: list[float], chunk_tokens: list[int]) -> list[float]:
    """Per-token gaps. A chunk of k tokens spreads the time since the previous token-carrying chunk over
    k gaps; a 0-token chunk (text of tokens counted earlier) adds none."""
    gaps: list[float] = []
    last = None
    for t, k in zip(chunk_times_s, chunk_tokens):
        if k <= 0:
            continue
        if last is not None:
            gaps.extend([(t - last) / k] * k)
        last = t
    return gaps


def apportion(total: int, weights: list[int]) -> list[int]:
    """Integers proportional to `weights` summing to `total` (largest remainder). With total >= the
    number of chunks every chunk gets at least one token: a chunk with text carries a token."""
    n = len(weights)
    if n == 0:
        return []
    base = [1] * n if total >= n else [0] * n
    extra = total - sum(base)
    w = [max(0, x) for x in weights]
    if sum(w) == 0:
        w = [1] * n
    shares = [extra * x / sum(w) for x in w]
    out = [b + int(q) for b, q in zip(base, shares)]
    order = sorted(range(n), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


STOP_TOKEN_SLACK = 1  # a server counts the stop token it generated but sent as no text


def chunk_token_counts(rec) -> tuple[list[int], str, str | None]:
    """(tokens per content chunk, where they came from, a mismatch to flag or None)."""
    n = len(rec.chunk_times_s)
    usage = (rec.usage or {}).get("completion_tokens")
    usage = usage if isinstance(usage, int) else None
    server = rec.chunk_tokens_server
    if n and len(server) == n and all(k is not None for k in server):
        source = f"server:{rec.chunk_server_kind}"
        total = sum(server)
        if usage is not None and not 0 <= usage - total <= STOP_TOKEN_SLACK:
            return list(server), source, f"per-chunk counts sum to {total}, usage says {usage}"
        return list(server), source, None
    text = rec.chunk_tokens_text
    if usage is not None:
        if text and len(text) == n:
            return apportion(usage, text), "usage apportioned by tokenizer", None
        return apportion(usage, rec.chunk_chars or [1] * n), "usage apportioned by characters", None
    if text and len(text) == n:
        return list(text), "tokenizer (no usage)", None
    return [1] * n, "assumed-1-per-chunk (no usage)", None


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
    m["observed_cache_state"] = observed_state(m["cached_tokens"])
    if not rec.chunk_times_s:
        return m
    rec.chunk_tokens, rec.token_source, mismatch = chunk_token_counts(rec)
    ttft = rec.chunk_times_s[0]
    e2e = rec.chunk_times_s[-1]
    chunk_sum = sum(rec.chunk_tokens)
    if isinstance(usage.get("completion_tokens"), int):
        out, source = usage["completion_tokens"], "usage"
    else:
        out, source = chunk_sum, "chunks:" + rec.token_source
    if rec.first_reasoning_s is not None:
        m["ttft_reasoning_s"] = rec.first_reasoning_s
        m["reasoning_chars"] = len(rec.reasoning_text)
    if rec.first_answer_s is not None:
        m["ttft_answer_s"] = rec.first_answer_s
    m.update(ttft_s=ttft, e2e_s=e2e, output_tokens=out, output_tokens_source=source, chunk_tokens=chunk_sum,
             chunk_token_source=rec.token_source)
    if mismatch:
        m["chunk_token_mismatch"] = mismatch
    after_first = chunk_sum - rec.chunk_tokens[0]
    if after_first > 0 and e2e > ttft:
        m["tpot_s"] = (e2e - ttft) / after_first
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
    """Output tokens of completed requests over the measurement window (which spans failed ones too: they
    held the server); peak over the best 1-s window. Each chunk's tokens are scaled so that a request's
    total equals its reported output tokens. Tokens of streams that failed partway are counted apart."""
    started = [r for r in measured(records) if r.chunk_times_s]
    recs = [r for r in started if r.ok]
    failed = [r for r in started if not r.ok]
    if not started:
        return {"n_requests": 0}
    start = min(r.t_sent_s for r in measured(records))
    end = max(r.t_sent_s + (r.done_s if r.done_s is not None else r.chunk_times_s[-1]) for r in started)
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
        "failed_streams": len(failed),
        "failed_stream_tokens": sum(sum(r.chunk_tokens) for r in failed),
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


def token_checks(records) -> tuple[list[str], list[str]]:
    """(flags, notes) on token counts. A flag: per-chunk counts that contradict usage, or a tokenizer
    recount more than 2% off usage when nothing else backs usage. When the server's own per-chunk counts
    add up to its usage, the figures do not rest on the recount, and a recount gap is a note: text
    re-tokenizes differently from how it was generated (repetitive text especially)."""
    flags, backed = [], []
    for r in measured(records):
        mismatch = r.metrics.get("chunk_token_mismatch")
        if mismatch:
            flags.append(f"request {r.request_id} ({r.group}): {mismatch}")
        recount = r.metrics.get("output_tokens_recounted")
        out = r.metrics.get("output_tokens")
        if recount is None or not out:
            continue
        gap = token_gap(out, recount, r.finish_reason)
        if gap <= TOKEN_GAP_LIMIT:
            continue
        if str(r.metrics.get("chunk_token_source", "")).startswith("server:") and not mismatch:
            backed.append(gap)
            continue
        flags.append(f"request {r.request_id} ({r.group}): server says {out} output tokens, tokenizer counts "
                     f"{recount} ({gap:.1%} > {TOKEN_GAP_LIMIT:.0%})")
    notes = []
    if backed:
        notes.append(f"{len(backed)} requests: the tokenizer's recount of the text is {min(backed):.0%}-{max(backed):.0%} "
                     "off usage, but the server's per-chunk counts add up to usage (text re-tokenizes differently "
                     "from how it was generated)")
    return flags, notes
