"""`sudu bench replay`: a session trace (sudu/bench/trace.py) sent to an endpoint with its timing, its tool
waits and its prefix sharing. Prompts are synthesized from the hash ids: every id stands for one block of
`block_size` words, each word one token on the server's tokenizer (checked with the model's tokenizer
when sudu has it), so requests with equal ids share exactly those prefix blocks and nothing more. The
reached hit rate (the server's own cached-token counts) is set against the trace's ideal, computed in the
order the requests were actually sent (an unbounded prefix cache that has seen every earlier request);
next to it, the same holding only prompts whose first token was out when each request was sent, which
says how much requests that share a prefix and arrive together could not share.

Scheduling: a request with a dependency starts when that response has been read plus its tool wait
(the DAG); one without starts at its arrival offset (open loop) or, in closed loop, sessions run
`concurrency` at a time, each as fast as its dependencies and tool waits allow. `speedup` divides every
arrival offset and tool wait."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Callable

from sudu.bench.trace import Trace, TraceRequest, ideal_cached_tokens, ideal_cached_tokens_timed
from sudu.bench.workloads import _WORDS

MODES = ("open", "closed")
LATE_TOLERANCE_S = 0.001


MIN_WORDS = 64  # fewer single-token common words than this: the tokenizer's vocabulary is searched


def single_token_words(tokenizer) -> list[str]:
    """Words w for which " w" is exactly one token of `tokenizer` (sudu.tokenizer.Tokenizer): the common
    English words that are, or else every such token of the vocabulary."""
    def one(w: str) -> bool:
        return len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1

    words = [w for w in sorted(set(_WORDS)) if one(w)]
    if len(words) >= MIN_WORDS:
        return words
    found = set(words)
    for i in range(tokenizer.backend.get_vocab_size()):
        text = tokenizer.decode([i])
        if len(text) > 1 and text[0] == " " and text[1:].isalnum() and tokenizer.encode(text, add_special_tokens=False) == [i]:
            found.add(text[1:])
    return sorted(found) or sorted(set(_WORDS))


class PromptSynth:
    """Token-exact prompts from hash ids: block h -> `block_size` space-led words drawn with seed (seed, h);
    a partial last block takes the first words of its block. With `words` that are one token each on the
    server's tokenizer (single_token_words), the prompt's token count is the trace's input_length;
    without, common English words (about one token each in BPE vocabularies)."""

    def __init__(self, block_size: int, seed: int = 0, words: list[str] | None = None):
        self.words = list(words) if words else sorted(set(_WORDS))
        self.block_size = block_size
        self.seed = seed
        self._blocks: dict[int, list[str]] = {}

    def block(self, h: int) -> list[str]:
        words = self._blocks.get(h)
        if words is None:
            rng = random.Random(f"{self.seed}:{h}")
            words = self._blocks[h] = [" " + w for w in rng.choices(self.words, k=self.block_size)]
        return words

    def prompt(self, req: TraceRequest) -> str:
        parts = []
        left = req.input_length
        for h in req.hash_ids:
            take = min(left, self.block_size)
            parts.extend(self.block(h)[:take])
            left -= take
        return "".join(parts)


@dataclass
class ReplayOptions:
    mode: str = "open"
    concurrency: int = 8  # closed loop: sessions in flight
    speedup: float = 1.0
    seed: int = 0


def body_for(req: TraceRequest, synth: PromptSynth) -> dict:
    """What `send` gets: the trace's own text when it has it (messages, or a recorded prompt), else the
    synthesized prompt (sent as raw text to completions, as one user message to the chat-style APIs)."""
    if req.messages:
        return {"messages": req.messages}
    return {"prompt": req.prompt if req.prompt is not None else synth.prompt(req)}


async def run_replay(ctx, trace: Trace, opts: ReplayOptions, send_one: Callable, synth: PromptSynth) -> list[dict]:
    """Send every request of `trace`; returns one row per request (schedule, timing, tokens), in trace
    order. `send_one(req, body) -> RequestRecord`."""
    speed = opts.speedup
    done = {r.index: asyncio.Event() for r in trace.requests}
    rows: dict[int, dict] = {}
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    async def one(req: TraceRequest, session_start: float | None) -> None:
        if req.after is not None:
            await done[req.after].wait()
            scheduled = rows[req.after]["done_s"] + req.tool_wait_s / speed
        elif session_start is not None:  # closed loop: a session's first request goes when it gets its slot
            scheduled = session_start
        else:
            scheduled = (req.at_s or 0.0) / speed
        delay = scheduled - now()
        if delay > 0:
            await asyncio.sleep(delay)
        start = now()
        row = {"index": req.index, "id": req.id, "session": req.session, "turn": req.turn,
               "after": trace.requests[req.after].id if req.after is not None else None,
               "tool_wait_s": req.tool_wait_s / speed, "scheduled_s": scheduled, "start_s": start,
               "input_length": req.input_length, "output_length": req.output_length}
        rows[req.index] = row
        try:
            rec = await send_one(req, body_for(req, synth))
            usage = rec.usage or {}
            row.update(request_id=rec.request_id, ok=rec.ok, error=rec.error, ttft_s=rec.metrics.get("ttft_s"),
                       prompt_tokens=usage.get("prompt_tokens"), cached_tokens=rec.metrics.get("cached_tokens"),
                       completion_tokens=usage.get("completion_tokens"))
        finally:
            row["done_s"] = now()
            done[req.index].set()

    if opts.mode == "open":
        await asyncio.gather(*(one(r, None) for r in trace.requests))
    else:
        slots = asyncio.Semaphore(opts.concurrency)
        by_session: dict[str, list[TraceRequest]] = {}
        for r in trace.requests:
            by_session.setdefault(r.session, []).append(r)

        async def session(reqs: list[TraceRequest]) -> None:
            async with slots:
                start = now()
                for r in reqs:
                    await one(r, start if r.after is None else None)

        await asyncio.gather(*(session(reqs) for reqs in by_session.values()))
    return [rows[i] for i in sorted(rows)]


def summarize(trace: Trace, rows: list[dict], opts: ReplayOptions) -> dict:
    """Reached vs ideal hit rate, the dependency and tool-wait check, lateness against the schedule, token
    fidelity of the synthesized prompts, and per-session spans."""
    ideal = ideal_cached_tokens_timed(
        trace, {r["index"]: r["start_s"] for r in rows},
        {r["index"]: r["start_s"] + r["ttft_s"] for r in rows if r.get("ok") and r.get("ttft_s") is not None})
    static = ideal_cached_tokens(trace, [r["index"] for r in sorted(rows, key=lambda r: r["start_s"])])
    for r in rows:
        r["ideal_cached_tokens"] = static[r["index"]]
        r["ideal_cached_tokens_computed"] = ideal[r["index"]]
    ok = [r for r in rows if r.get("ok")]
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    reported = [r for r in ok if r.get("cached_tokens") is not None]
    cached = sum(r["cached_tokens"] for r in reported)
    trace_tokens = sum(r["input_length"] for r in ok)
    ideal_rate = sum(r["ideal_cached_tokens"] for r in ok) / trace_tokens if trace_tokens else None
    computed_rate = sum(r["ideal_cached_tokens_computed"] for r in ok) / trace_tokens if trace_tokens else None
    reached = cached / prompt if prompt and reported else None
    by_index = {r["index"]: r for r in rows}
    violations = []
    for r in rows:
        req = trace.requests[r["index"]]
        if req.after is None:
            continue
        dep = by_index[req.after]
        earliest = dep["done_s"] + r["tool_wait_s"]
        if r["start_s"] < earliest - LATE_TOLERANCE_S:
            violations.append(f"{r['id']} started {1e3 * (earliest - r['start_s']):.1f} ms before {dep['id']} "
                              f"answered + its tool wait")
    late = [r["start_s"] - r["scheduled_s"] for r in rows]
    excess = [r["prompt_tokens"] - r["input_length"] for r in ok if r.get("prompt_tokens") is not None]
    sessions = {}
    for r in rows:
        s = sessions.setdefault(r["session"], {"session": r["session"], "requests": 0, "ok": 0, "start_s": r["start_s"],
                                               "end_s": r["done_s"], "tool_wait_s": 0.0})
        s["requests"] += 1
        s["ok"] += bool(r.get("ok"))
        s["start_s"] = min(s["start_s"], r["start_s"])
        s["end_s"] = max(s["end_s"], r["done_s"])
        s["tool_wait_s"] += r["tool_wait_s"] if r["after"] is not None else 0.0
    for s in sessions.values():
        s["span_s"] = s["end_s"] - s["start_s"]
    return {
        "trace": trace.path, "format": trace.format, "block_size": trace.block_size, "mode": opts.mode,
        "speedup": opts.speedup, "concurrency": opts.concurrency if opts.mode == "closed" else None,
        "requests": len(rows), "requests_ok": len(ok), "sessions": len(sessions),
        "reached_hit_rate": reached, "ideal_hit_rate": ideal_rate, "ideal_hit_rate_computed": computed_rate,
        "hit_rate_gap_points": None if reached is None or ideal_rate is None else 100 * (reached - ideal_rate),
        "cached_reported": bool(reported),
        "prompt_tokens": prompt, "trace_input_tokens": trace_tokens,
        "prompt_token_excess_mean": sum(excess) / len(excess) if excess else None,
        "dependency_violations": violations, "dependencies": sum(1 for r in rows if r["after"] is not None),
        "start_lateness_max_s": max(late) if late else None,
        "start_lateness_mean_s": sum(late) / len(late) if late else None,
        "session_runs": list(sessions.values()), "rows": rows,
    }


def markdown(s: dict) -> str:
    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"

    gap = s["hit_rate_gap_points"]
    excess = s["prompt_token_excess_mean"]
    lines = [f"{s['requests_ok']}/{s['requests']} requests in {s['sessions']} sessions ({s['format']} trace, "
             f"{s['block_size']}-token blocks, {s['mode']} loop, speedup {s['speedup']:g}).",
             f"Hit rate reached {pct(s['reached_hit_rate'])} vs the trace's ideal {pct(s['ideal_hit_rate'])} "
             f"({'n/a' if gap is None else f'{gap:+.1f} points'}; the server's cached tokens / prompt tokens; the ideal: "
             "an unbounded prefix cache that has seen every request sent before; holding only the prompts whose first "
             f"token was out when each request was sent: {pct(s.get('ideal_hit_rate_computed'))})."
             + ("" if s["cached_reported"] else " The server reports no cached tokens."),
             f"Prompt tokens per request vs the trace: {'n/a' if excess is None else f'{excess:+.1f}'} "
             "on average (a chat template's own tokens, or words the tokenizer split).",
             f"Dependencies: {s['dependencies']}, violated: {len(s['dependency_violations'])}; start lateness vs the "
             f"schedule: mean {1e3 * (s['start_lateness_mean_s'] or 0):.1f} ms, max {1e3 * (s['start_lateness_max_s'] or 0):.1f} ms."]
    return "\n\n".join(lines)
