"""The measuring HTTP client of sudu bench: one streaming chat request -> one RequestRecord with the
arrival time of every content chunk. httpx.AsyncClient does the HTTP; this file only parses the SSE
`data:` lines of the body, which keeps the per-chunk cost small and the timestamps honest
(time.perf_counter() taken as the bytes arrive, before any JSON is decoded).

Per content chunk the client keeps what it can learn about its token count: the server's own count
(`choices[0].logprobs.content` entries, or the increase of a cumulative `usage.completion_tokens` sent
with `stream_options.continuous_usage_stats`), the model tokenizer's count of the chunk's text when a
`count_tokens` callable is given, and the text's length. `metrics.chunk_token_counts` decides from
these, and says which it used.

Tool calls streamed as `delta.tool_calls` (id, type and name first, then the arguments in pieces, keyed
by `index`) are assembled into `RequestRecord.tool_calls`; their chunks are output chunks like content.
"""
from __future__ import annotations

import json
import ssl
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable
from urllib.parse import urlsplit

import httpx

from sudu.bench.apis import ENDPOINTS, message_text, parse_event, tool_calls as api_tool_calls, translate

TOKENS_ASSUMED_ONE = "assumed-1-per-chunk"


@dataclass
class RequestRecord:
    """Everything observed about one request; times are seconds relative to `t_sent_s`."""

    request_id: int
    group: str  # the workload point this request belongs to, e.g. "concurrency=4"
    cache_state: str  # declared: cold | warm | shared-prefix | shared-image | trace
    warmup: bool = False
    t_sent_s: float = 0.0  # perf_counter() just before the request was handed to httpx
    status: int | None = None
    error: str | None = None
    first_byte_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # content chunks only
    chunk_tokens: list[int] = field(default_factory=list)  # decided by metrics.chunk_token_counts
    token_source: str = TOKENS_ASSUMED_ONE
    chunk_tokens_server: list[int | None] = field(default_factory=list)  # the server's count, None: not told
    chunk_server_kind: str | None = None  # "usage" (continuous usage stats) or "logprobs"
    chunk_tokens_text: list[int] | None = None  # the tokenizer on each chunk's text
    chunk_chars: list[int] = field(default_factory=list)
    finish_s: float | None = None  # the chunk carrying finish_reason
    done_s: float | None = None  # body fully read
    text: str = ""  # the answer (reasoning apart)
    reasoning_text: str = ""  # reasoning_content deltas (chat), thinking blocks (messages), reasoning items (responses)
    first_reasoning_s: float | None = None  # first chunk carrying reasoning
    first_answer_s: float | None = None  # first chunk carrying answer text or a tool call
    api: str = "chat"
    session: str | None = None  # the unit costs are summed over: a replayed session, a conversation, a task run
    tool_calls: list[dict] | None = None  # [{"id", "type", "function": {"name", "arguments"}}] by index
    finish_reason: str | None = None
    usage: dict | None = None
    sudu: dict | None = None  # sudu's timing breakdown (final usage / finish chunk)
    server_timing: dict | None = None  # parsed Server-Timing header, seconds
    prompt_chars: int = 0
    max_tokens: int | None = None
    task: str | None = None
    images: list[dict] | None = None  # the images sent (size, PNG bytes, digest): the multimodal suite's
    resent: int = 0  # times sent again because the server closed a kept-alive connection before responding
    metrics: dict = field(default_factory=dict)  # filled by metrics.request_metrics

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and bool(self.chunk_times_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def api_base(url: str) -> str:
    """`http://host:8000` -> `http://host:8000/v1`; a URL that already has a path is used as given."""
    url = url.rstrip("/")
    if urlsplit(url).path in ("", "/"):
        return url + "/v1"
    return url


def make_client(max_connections: int = 1, timeout_s: float = 600.0, verify=True) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=60.0
    )
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0), verify=verify)


class ClientPool:
    """One single-connection httpx.AsyncClient per concurrently running request. httpcore's pool scans
    every connection for every request it assigns (its cost: docs/bench.md), so
    many small pools keep the cost per request flat; keep-alive connections are still reused."""

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self._free: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []
        self._ssl_context = None  # loading CA certificates is slow: once per pool, not per client

    @asynccontextmanager
    async def acquire(self):
        client = self._free.pop() if self._free else None
        if client is None:
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            client = make_client(1, self.timeout_s, verify=self._ssl_context)
            self._all.append(client)
        try:
            yield client
        finally:
            self._free.append(client)

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()
        self._free.clear()
        self._all.clear()

    async def __aenter__(self) -> "ClientPool":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def auth_headers(api_key: str | None) -> dict:
    headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def chat_body(model: str, messages: list[dict], max_tokens: int, temperature: float = 0.0,
              continuous_usage: bool = False, **extra) -> dict:
    options = {"include_usage": True}
    if continuous_usage:
        options["continuous_usage_stats"] = True
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": options,
    }
    body.update(extra)
    return body


def parse_server_timing(value: str | None) -> dict | None:
    """`queue;dur=1.5, prefill;dur=20` -> {"queue_s": 0.0015, "prefill_s": 0.02}."""
    if not value:
        return None
    out = {}
    for entry in value.split(","):
        parts = [p.strip() for p in entry.split(";")]
        name = parts[0]
        for p in parts[1:]:
            if p.startswith("dur="):
                try:
                    out[f"{name}_s"] = float(p[4:]) / 1000.0
                except ValueError:
                    pass
    return out or None


async def fetch_server_info(client: httpx.AsyncClient, base: str, headers: dict) -> dict:
    """GET /v1/models, recorded in every report; failures are recorded, not raised."""
    try:
        resp = await client.get(f"{base}/models", headers=headers, timeout=30.0)
        info = {"status": resp.status_code}
        try:
            info["models"] = resp.json()
        except ValueError:
            info["body"] = resp.text[:500]
        return info
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _server_token_count(chunk: dict, choice: dict, prev_completion_tokens: list[int]) -> tuple[int | None, str | None]:
    """(tokens this content chunk carries, "logprobs" | "usage") as the server tells it, else (None, None).
    A cumulative count that did not grow is 0 tokens: the text of tokens counted on an earlier chunk."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list) and logprobs["content"]:
        return len(logprobs["content"]), "logprobs"
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        k = usage["completion_tokens"] - prev_completion_tokens[0]
        prev_completion_tokens[0] = usage["completion_tokens"]
        return max(0, k), "usage"
    return None, None


def add_tool_call_deltas(calls: dict[int, dict], deltas: list) -> str:
    """Merge one chunk's `delta.tool_calls` into `calls` (by index: the id, type and name when they come,
    the arguments appended); returns the text the chunk carried (names and argument pieces)."""
    carried = ""
    for d in deltas:
        if not isinstance(d, dict):
            continue
        index = d.get("index") if isinstance(d.get("index"), int) else len(calls)
        call = calls.setdefault(index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if d.get("id"):
            call["id"] = d["id"]
        if d.get("type"):
            call["type"] = d["type"]
        fn = d.get("function") or {}
        for key in ("name", "arguments"):
            if isinstance(fn.get(key), str):
                call["function"][key] += fn[key]
                carried += fn[key]
    return carried


# A server may close a kept-alive connection just after a response (llama-server does after every
# streamed one, while its headers say keep-alive); a request sent on it in that instant fails before any
# byte comes back. The server never saw it, so it is sent once more on a new connection, timed from then.
def _stale_connection(exc: httpx.HTTPError) -> bool:
    return isinstance(exc, httpx.WriteError) or (
        isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc))


@asynccontextmanager
async def _open_stream(client: httpx.AsyncClient, url: str, payload: bytes, headers: dict, record: RequestRecord):
    try:
        cm = client.stream("POST", url, content=payload, headers=headers)
        resp = await cm.__aenter__()
    except httpx.HTTPError as exc:
        if not _stale_connection(exc):
            raise
        record.resent += 1
        record.t_sent_s = time.perf_counter()
        cm = client.stream("POST", url, content=payload, headers=headers)
        resp = await cm.__aenter__()
    try:
        yield resp
    except BaseException as exc:
        if not await cm.__aexit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        await cm.__aexit__(None, None, None)


async def stream_chat(
    client: httpx.AsyncClient,
    base: str,
    body: dict,
    headers: dict,
    record: RequestRecord,
    count_tokens: Callable[[str], int] | None = None,
    api: str = "chat",
) -> RequestRecord:
    """Send one streaming request (a chat body, translated to `api`: chat, completions, messages or
    responses) and fill `record`. Never raises for server or network errors: they end up in
    `record.error` (a failed request is data, not a crash)."""
    perf = time.perf_counter
    record.api = api
    record.max_tokens = body.get("max_tokens")
    record.prompt_chars = (len(body["prompt"]) if isinstance(body.get("prompt"), str)
                           else sum(len(message_text(m.get("content"))) for m in body.get("messages", [])))
    if api != "chat" or "prompt" in body:
        body = translate(body, api)
    text_parts: list[str] = []
    reasoning_parts: list[str] = []
    calls: dict[int, dict] = {}
    state: dict = {}
    prev_completion_tokens = [0]
    kinds: set[str] = set()
    if count_tokens is not None:
        record.chunk_tokens_text = []
    saw_done = False
    payload = json.dumps(body).encode()
    t0 = perf()
    record.t_sent_s = t0
    try:
        async with _open_stream(client, f"{base}{ENDPOINTS[api]}", payload, headers, record) as resp:
            t0 = record.t_sent_s  # a resend restarts the clock
            record.status = resp.status_code
            record.server_timing = parse_server_timing(resp.headers.get("server-timing"))
            if resp.status_code != 200:
                err = (await resp.aread()).decode("utf-8", "replace")
                record.done_s = perf() - t0
                record.error = f"HTTP {resp.status_code}: {err[:300]}"
                return record
            buf = b""
            data_lines: list[bytes] = []
            event_name: str | None = None
            # aiter_raw skips httpx's (identity) decoder chain; a compressed stream goes through it
            encoded = resp.headers.get("content-encoding", "identity") != "identity"
            async for raw in (resp.aiter_bytes() if encoded else resp.aiter_raw()):
                t = perf() - t0
                if record.first_byte_s is None:
                    record.first_byte_s = t
                buf += raw
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        break
                    line = buf[:nl].rstrip(b"\r")
                    buf = buf[nl + 1 :]
                    if line.startswith(b"data:"):
                        data_lines.append(line[5:].lstrip(b" "))
                        continue
                    if line.startswith(b"event:"):
                        event_name = line[6:].strip().decode("utf-8", "replace")
                        continue
                    if line or not data_lines:
                        continue  # comments, id:/retry: fields
                    event_data = b"\n".join(data_lines)
                    data_lines = []
                    if event_data == b"[DONE]":
                        saw_done = True
                        continue
                    try:
                        chunk = json.loads(event_data)
                    except ValueError:
                        record.error = f"unparseable SSE data: {event_data[:120]!r}"
                        continue
                    if not isinstance(chunk, dict):
                        record.error = f"unexpected SSE data: {event_data[:120]!r}"
                        continue
                    parsed = parse_event(api, event_name, chunk, state)
                    event_name = None
                    if parsed.error:
                        record.error = parsed.error
                        continue
                    if parsed.usage:
                        record.usage = parsed.usage
                    if isinstance(chunk.get("sudu"), dict):
                        record.sudu = chunk["sudu"]
                    piece = "".join(text for _, text in parsed.pieces)
                    if parsed.tool_deltas:
                        piece += add_tool_call_deltas(calls, parsed.tool_deltas)
                    if piece:
                        for kind, text in parsed.pieces:
                            if kind == "reasoning":
                                reasoning_parts.append(text)
                                if record.first_reasoning_s is None:
                                    record.first_reasoning_s = t
                            else:
                                if kind == "answer":
                                    text_parts.append(text)
                                if record.first_answer_s is None:
                                    record.first_answer_s = t
                        if parsed.tool_deltas and record.first_answer_s is None:
                            record.first_answer_s = t
                        choices = chunk.get("choices") or [{}]
                        k, kind = _server_token_count(chunk, choices[0], prev_completion_tokens)
                        if kind:
                            kinds.add(kind)
                        record.chunk_times_s.append(t)
                        record.chunk_tokens_server.append(k)
                        record.chunk_chars.append(len(piece))
                        if count_tokens is not None:
                            record.chunk_tokens_text.append(max(1, count_tokens(piece)))
                    if parsed.finish_reason:
                        record.finish_reason = parsed.finish_reason
                        record.finish_s = t
                    if parsed.done:
                        saw_done = True
            record.done_s = perf() - t0
    except httpx.HTTPError as exc:
        record.done_s = perf() - t0
        err = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        record.error = err if record.error is None else f"{record.error}; then {err}"
    record.text = "".join(text_parts)
    record.reasoning_text = "".join(reasoning_parts)
    if calls:
        record.tool_calls = [calls[i] for i in sorted(calls)]
    elif api in ("messages", "responses"):
        record.tool_calls = api_tool_calls(state)
    record.chunk_server_kind = "+".join(sorted(kinds)) or None
    if record.error is None and not saw_done and record.finish_reason is None:
        record.error = "stream ended without finish_reason or [DONE]"
    if record.error is None and not record.chunk_times_s:
        record.error = "no content chunk received"
    return record
