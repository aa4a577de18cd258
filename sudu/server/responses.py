"""Rendering one call's engine outputs as OpenAI's answers: a single JSON body or the SSE chunks of a
stream, for chat and text completions. `Call` keeps the per-choice accounting both need and feeds the
per-request metrics (`Call.observe`); `usage_body` builds `usage`, `timing_body` the `sudu` timing
extension: each is the one place its fields are made."""
from __future__ import annotations

import json
import time
from contextlib import aclosing
from typing import AsyncIterator, Callable

from fastapi.responses import JSONResponse

from sudu.engine.outputs import RequestOutput
from sudu.server import protocol as P
from sudu.server import tool_output
from sudu.server.answer_events import AnswerEvents, gather
from sudu.server.engine_protocol import ServingEngine
from sudu.server.errors import EngineRequestError, failed_call
from sudu.server.generation import generate_all
from sudu.server.metrics import ServerMetrics
from sudu.server.requests import PreparedCall

_LOGPROB_FLOOR = -9999.0  # -inf is not valid JSON
_PHASES = ("queue_s", "prefill_s", "decode_s", "ttft_s")


def usage_body(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
        "prompt_cache_hit_tokens": num_cached_tokens,
        "prompt_cache_miss_tokens": num_prompt_tokens - num_cached_tokens,
    }


def timing_body(out: RequestOutput, now: float) -> dict:
    """The `sudu` extension of one engine request, as of `now` (its decode phase runs until it finishes)."""
    m = out.metrics
    if m.finished_time is not None or m.first_token_time is None:
        decode_s = m.decode_s
    else:
        decode_s = now - m.first_token_time
    ttft_s = (m.first_token_time - m.arrival_time) if m.first_token_time is not None else 0.0
    timing = {"queue_s": round(m.queue_s, 6), "prefill_s": round(m.prefill_s, 6), "decode_s": round(decode_s, 6),
              "ttft_s": round(ttft_s, 6), "cached_tokens": out.num_cached_tokens,
              "cached_tokens_disk": out.num_cached_tokens_disk, "disk_load_s": round(m.disk_load_s, 6)}
    if out.route:  # served through the cluster ingress: which replica, and the router's prediction
        timing.update(out.route)
    if m.num_spec_steps:  # speculative decoding ran for this request
        timing.update(num_draft_tokens=m.num_draft_tokens, num_accepted_tokens=m.num_accepted_tokens,
                      acceptance_rate=round(m.acceptance_rate, 4), mean_accepted_len=round(m.mean_accepted_len, 4))
    return timing


def _merge_timings(timings: list[dict]) -> dict:
    """Several prompts in one call: the slowest of each phase, the sum of cached tokens."""
    if len(timings) == 1:
        return timings[0]
    merged = {k: max(t[k] for t in timings) for k in _PHASES}
    for key in ("cached_tokens", "cached_tokens_disk", "disk_load_s"):
        merged[key] = sum(t.get(key, 0) for t in timings)
    drafted = sum(t.get("num_draft_tokens", 0) for t in timings)
    if drafted:
        accepted = sum(t.get("num_accepted_tokens", 0) for t in timings)
        merged.update(num_draft_tokens=drafted, num_accepted_tokens=accepted,
                      acceptance_rate=round(accepted / drafted, 4))
    return merged


def _server_timing(timing: dict) -> str:
    return ", ".join(f"{k};dur={timing[k + '_s'] * 1000:.3f}" for k in ("queue", "prefill", "decode"))


def _chat_logprobs(entries) -> list[dict]:
    return [
        {
            "token": e.token, "logprob": max(e.logprob, _LOGPROB_FLOOR), "bytes": list(e.token.encode()),
            "top_logprobs": [
                {"token": text, "logprob": max(lp, _LOGPROB_FLOOR), "bytes": list(text.encode())}
                for _, text, lp in e.top
            ],
        }
        for e in entries
    ]


class _CompletionLogprobs:
    """OpenAI's legacy completions logprobs shape, with text offsets running across stream chunks."""

    def __init__(self, start_offset: int = 0):
        self.offset = start_offset

    def render(self, entries) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            tokens.append(e.token)
            token_logprobs.append(max(e.logprob, _LOGPROB_FLOOR))
            top.append({text: max(lp, _LOGPROB_FLOOR) for _, text, lp in e.top})
            offsets.append(self.offset)
            self.offset += len(e.token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class Call:
    """One API call in flight: its engine jobs, per-choice accounting, metrics, and the two renderings
    (stream / single body) of chat and text completions."""

    def __init__(self, engine: ServingEngine, metrics: ServerMetrics, prepared: PreparedCall, model: str,
                 object_: str, received_at: float, is_draining: Callable[[], bool]):
        self.engine, self.metrics, self.is_draining = engine, metrics, is_draining
        jobs = self.jobs = prepared.jobs
        self.n, self.logprobs, self.echo = prepared.n, prepared.logprobs, prepared.echo
        self.tool_format = prepared.tool_format
        self.reasoning, self.reasoning_open = prepared.reasoning, prepared.reasoning_open
        self.tool_schemas = prepared.tool_schemas
        self.reasoning_tokens = [0] * (len(jobs) * self.n)
        self.model = model
        self.id = jobs[0].request_id.rsplit("-", 1)[0] if len(jobs) > 1 else jobs[0].request_id
        self.object = object_
        self.created = int(time.time())
        self.received_at = received_at  # handler entry: TTFT and e2e metrics include templating + tokenizing
        num_choices = len(jobs) * self.n
        self.num_tokens = [0] * num_choices
        self.finish_reasons: list[str | None] = [None] * num_choices
        self.timings: list[dict | None] = [None] * len(jobs)
        self.num_cached = [0] * len(jobs)
        self._first_token_at: list[float | None] = [None] * len(jobs)
        self._last_token_at: list[float | None] = [None] * len(jobs)
        for job in jobs:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))

    # -- accounting shared by every rendering

    def observe(self, job_index: int, out: RequestOutput) -> float:
        """Count tokens and feed the per-request metrics; returns now."""
        now = time.perf_counter()
        new_tokens = 0
        for c in out.outputs:
            idx = job_index * self.n + c.index
            self.num_tokens[idx] = max(self.num_tokens[idx] + len(c.token_ids), c.num_output_tokens)
            new_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons[idx] = c.finish_reason
                self.metrics.request_success.labels(finish_reason=c.finish_reason).inc()
        if new_tokens:
            self.metrics.generation_tokens.inc(new_tokens)
            if self._first_token_at[job_index] is None:
                self._first_token_at[job_index] = now
                self.metrics.time_to_first_token.observe(now - self.received_at)
                if out.metrics.first_token_time is not None:
                    self.metrics.actual_wait.observe(out.metrics.first_token_time - out.metrics.arrival_time)
            else:
                self.metrics.inter_token_latency.observe(now - self._last_token_at[job_index])
            self._last_token_at[job_index] = now
        self.num_cached[job_index] = out.num_cached_tokens
        if out.finished:
            self.timings[job_index] = timing_body(out, now)
            self.metrics.e2e_request_latency.observe(now - self.received_at)
            self.metrics.request_queue_time.observe(out.metrics.queue_s)
        return now

    def usage(self) -> dict:
        usage = usage_body(sum(len(j.prompt_ids) for j in self.jobs), sum(self.num_tokens), sum(self.num_cached))
        if self.reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(self.reasoning_tokens)}
        return usage

    def timing(self) -> dict:
        return _merge_timings([t or {**dict.fromkeys(_PHASES, 0.0), "cached_tokens": c}
                               for t, c in zip(self.timings, self.num_cached)])

    def _chunk(self, choices: list[dict], **extra) -> bytes:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices}
        body.update(extra)
        return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    # -- single JSON bodies

    async def _collect(self) -> tuple[list[list[str]], list[list]]:
        texts: list[list[str]] = [[] for _ in self.num_tokens]
        logprob_entries: list[list] = [[] for _ in self.num_tokens]
        self.piece_tokens: list[list[int]] = [[] for _ in self.num_tokens]  # tokens behind each text piece
        async with aclosing(generate_all(self.engine, self.jobs)) as outputs:
            async for job_index, out in outputs:
                self.observe(job_index, out)
                for c in out.outputs:
                    idx = job_index * self.n + c.index
                    texts[idx].append(c.text)
                    self.piece_tokens[idx].append(len(c.token_ids))
                    if c.logprobs:
                        logprob_entries[idx].extend(c.logprobs)
                if out.error is not None:
                    raise EngineRequestError(out.error)
        return texts, logprob_entries

    def _json(self, choices: list[dict]) -> JSONResponse:
        timing = self.timing()
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(), "sudu": timing}
        headers = {"Server-Timing": _server_timing(timing)}
        if "replica" in timing:
            headers["X-Sudu-Route"] = f"replica={timing['replica']}; predicted_cached_tokens={timing['predicted_cached_tokens']}"
        return JSONResponse(body, headers=headers)

    async def chat_response(self) -> JSONResponse:
        texts, entries = await self._collect()
        choices = []
        for i in range(len(texts)):
            text, reason = "".join(texts[i]), self.finish_reasons[i]
            if self.reasoning:
                events = AnswerEvents(self.tool_format, True, self.reasoning_open, self.tool_schemas)
                gathered = [e for piece, n in zip(texts[i], self.piece_tokens[i]) if piece
                            for e in events.feed(piece, n)]
                message = tool_output.answer_message(gather(gathered + events.finish(), events.reasoning_seen))
                self.reasoning_tokens[i] = events.reasoning_tokens
                reason = tool_output.finish_reason(reason, events.called)
            elif self.tool_format is not None:
                message, called = tool_output.message(text, self.tool_format, self.tool_schemas)
                reason = tool_output.finish_reason(reason, called)
            else:
                message = {"role": "assistant", "content": text}
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": _chat_logprobs(entries[i])} if self.logprobs is not None else None,
                            "finish_reason": reason})
        return self._json(choices)

    async def completion_response(self) -> JSONResponse:
        texts, entries = await self._collect()
        choices = []
        for i in range(len(texts)):
            prefix = self.echo[i // self.n] if self.echo else ""
            logprobs = _CompletionLogprobs(len(prefix)).render(entries[i]) if self.logprobs is not None else None
            choices.append({"index": i, "text": prefix + "".join(texts[i]), "logprobs": logprobs,
                            "finish_reason": self.finish_reasons[i]})
        return self._json(choices)

    # -- streams

    async def chat_stream(self, options: P.StreamOptions) -> AsyncIterator[bytes]:
        self.object = "chat.completion.chunk"
        for i in range(len(self.num_tokens)):
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])

        tools = None
        if self.tool_format or self.reasoning:
            tools = [tool_output.ChoiceStream(self.tool_format, self.reasoning, self.reasoning_open, self.tool_schemas)
                     for _ in self.num_tokens]

        def choices(idx, text, logprobs, finish_reason, num_tokens=0):
            rendered = None
            if logprobs is not None:
                rendered = {"content": _chat_logprobs(logprobs)}
            if tools is None:
                return [{"index": idx, "delta": {"content": text} if text is not None else {}, "logprobs": rendered,
                         "finish_reason": finish_reason}]
            deltas, finish_reason = tools[idx].render(text, finish_reason, num_tokens)
            self.reasoning_tokens[idx] = tools[idx].reasoning_tokens
            if rendered is not None and not deltas:
                deltas = [{}]
            out = [{"index": idx, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            if out:
                out[0]["logprobs"] = rendered
                out[-1]["finish_reason"] = finish_reason
            return out

        async for chunk in self._stream(options, choices):
            yield chunk

    async def completion_stream(self, options: P.StreamOptions) -> AsyncIterator[bytes]:
        offsets = [_CompletionLogprobs() for _ in self.num_tokens]
        if self.echo:
            for i in range(len(self.num_tokens)):
                prefix = self.echo[i // self.n]
                offsets[i].offset = len(prefix)
                yield self._chunk([{"index": i, "text": prefix, "logprobs": None, "finish_reason": None}])

        def choices(idx, text, logprobs, finish_reason, num_tokens=0):
            rendered = offsets[idx].render(logprobs) if logprobs is not None else None
            return [{"index": idx, "text": text or "", "logprobs": rendered, "finish_reason": finish_reason}]

        async for chunk in self._stream(options, choices):
            yield chunk

    async def _stream(self, options: P.StreamOptions, choices) -> AsyncIterator[bytes]:
        """Content chunks, a finish chunk per choice (with sudu's timing), the optional usage chunk and
        [DONE]. choices(index, text | None, logprobs | None, finish_reason) renders one API's choices for
        that piece: usually one, none while a tool call's text is held back, several when it settles."""
        want_logprobs = self.logprobs is not None
        running_usage = options.continuous_usage_stats
        try:
            async with aclosing(generate_all(self.engine, self.jobs)) as outputs:
                async for job_index, out in outputs:
                    now = self.observe(job_index, out)
                    for c in out.outputs:
                        idx = job_index * self.n + c.index
                        if c.text or (want_logprobs and c.logprobs):
                            for rendered in choices(idx, c.text, (c.logprobs or []) if want_logprobs else None, None,
                                                    len(c.token_ids)):
                                chunk = [rendered]
                                yield self._chunk(chunk, usage=self.usage()) if running_usage else self._chunk(chunk)
                        if c.finish_reason is not None and out.error is None:
                            rendered = choices(idx, None, None, c.finish_reason)
                            for piece in rendered[:-1]:
                                yield self._chunk([piece])
                            yield self._chunk(rendered[-1:], sudu=timing_body(out, now))
                    if out.error is not None:
                        raise EngineRequestError(out.error)
            if options.include_usage:
                yield self._chunk([], usage=self.usage(), sudu=self.timing())
        except Exception as exc:  # noqa: BLE001 -- a stream ends with an error event, never cut short
            err = failed_call(exc, self.is_draining())
            self.metrics.count_error(err)
            yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
