"""A scripted fake OpenAI chat server for testing sudu bench: a real HTTP/1.1 server on 127.0.0.1 (raw
asyncio streams, chunked transfer encoding, keep-alive) that sends each SSE event at an exact offset
from the moment the request was read. Used by the tests (in a thread) and by the client-overhead
benchmark (`python -m sudu.bench.fake_server --port N`, in its own process, answering instantly).

Scripts are written as chat-completions streams; a request to /v1/completions, /v1/messages or
/v1/responses gets the same script in that API's stream format (fake_apis.py). `LoadLatency` is a script
whose TTFT and ITL grow with the requests in flight past a knee (a known load -> latency curve), and
`server.log` keeps, per request, its path, body and when it was read and answered."""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from sudu.bench.fake_apis import api_of, convert_events


@dataclass
class Event:
    at_s: float  # offset from the request being read
    data: dict | str | bytes  # dict -> `data: <json>`, "[DONE]" -> `data: [DONE]`, bytes sent as-is


@dataclass
class ScriptedResponse:
    events: list[Event] = field(default_factory=list)
    status: int = 200
    headers: dict = field(default_factory=dict)
    headers_at_s: float = 0.0  # a slow first byte: nothing at all is sent before this offset
    abort_after_events: bool = False  # drop the connection without ending the body (error mid-stream)
    body: bytes | None = None  # a non-streaming body (used for error statuses)


def _chunk(model: str, delta: dict | None = None, finish_reason: str | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    out = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model, "choices": choices}
    out.update(extra)
    return out


def chat_script(
    pieces: list[tuple[float, str | dict]],
    *,
    role_at_s: float | None = 0.0,
    usage: dict | None = None,
    sudu: dict | None = None,
    finish_at_s: float | None = None,
    model: str = "fake",
    logprob_tokens: list[int] | None = None,
    continuous_usage_tokens: list[int] | None = None,
    headers_at_s: float = 0.0,
    headers: dict | None = None,
    finish_reason: str = "stop",
) -> ScriptedResponse:
    """A streaming answer: an optional role-only first chunk, `pieces` (offset, content text or a whole
    delta dict, e.g. from `tool_call_deltas`), a finish chunk, a usage chunk when `usage` is given, and
    [DONE]. `logprob_tokens[i]` attaches that many
    logprob entries to piece i, `continuous_usage_tokens[i]` a running usage that grew by that much with
    piece i (two ways for a server to tell how many tokens a chunk carries)."""
    events: list[Event] = []
    if role_at_s is not None:
        events.append(Event(role_at_s, _chunk(model, {"role": "assistant", "content": ""})))
    for i, (at, piece) in enumerate(pieces):
        c = _chunk(model, piece if isinstance(piece, dict) else {"content": piece})
        if logprob_tokens is not None:
            c["choices"][0]["logprobs"] = {"content": [{"token": "t", "logprob": 0.0}] * logprob_tokens[i]}
        if continuous_usage_tokens is not None:
            done = sum(continuous_usage_tokens[: i + 1])
            c["usage"] = {"prompt_tokens": 3, "completion_tokens": done, "total_tokens": 3 + done}
        events.append(Event(at, c))
    end = finish_at_s if finish_at_s is not None else (pieces[-1][0] if pieces else 0.0)
    finish = _chunk(model, {}, finish_reason)
    if sudu is not None:
        finish["sudu"] = sudu
    events.append(Event(end, finish))
    if usage is not None:
        u = _chunk(model, None, usage=usage)
        if sudu is not None:
            u["sudu"] = sudu
        events.append(Event(end, u))
    events.append(Event(end, "[DONE]"))
    return ScriptedResponse(events=events, headers_at_s=headers_at_s, headers=headers or {})


def tool_call_deltas(calls: list[tuple[str, str]], piece_chars: int = 7, id_prefix: str = "call_") -> list[dict]:
    """`delta`s streaming tool calls (name, arguments JSON) as OpenAI does: per call, one delta with its
    index, id, type and name (arguments ""), then the arguments in pieces of `piece_chars`."""
    out = []
    for i, (name, arguments) in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": f"{id_prefix}{i}", "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        out += [{"tool_calls": [{"index": i, "function": {"arguments": arguments[k:k + piece_chars]}}]}
                for k in range(0, len(arguments), piece_chars)]
    return out


def instant_script(body: dict, num_chunks: int = 8) -> ScriptedResponse:
    """Answers at once: role chunk, `num_chunks` one-token chunks, usage, [DONE]."""
    model = body.get("model", "fake")
    pieces = [(0.0, f" tok{i}") for i in range(num_chunks)]
    usage = {"prompt_tokens": 10, "completion_tokens": num_chunks, "total_tokens": 10 + num_chunks}
    return chat_script(pieces, usage=usage, model=model)


def _encode(data: dict | str | bytes) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return f"data: {data}\n\n".encode()
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _http_chunk(payload: bytes) -> bytes:
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


_FINE_WAIT_S = 0.002
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}


class FakeServer:
    """`with FakeServer(script_fn) as srv: srv.url` -> an OpenAI-style base URL ending in /v1."""

    def __init__(self, script_fn: Callable[[dict], ScriptedResponse] | None = None, host: str = "127.0.0.1", port: int = 0,
                 drop_reused: int = 0):
        self.script_fn = script_fn or instant_script
        # this many requests that arrive on a kept-alive connection are read and answered by closing it, as a
        # server that closed the connection just as the client reused it
        self.drop_reused = drop_reused
        self.dropped = 0
        self.host = host
        self.port = port
        self.requests: list[dict] = []  # every chat body received
        self.read_at: list[float] = []  # per request: perf_counter() when it had been read (the offsets' zero)
        self.sent_at_s: list[list[float]] = []  # per request: actual send offsets of each event
        self.log: list[dict] = []  # per request: path, body, read_at and done_at (perf_counter())
        self.current_path = "/v1/chat/completions"  # the path of the request whose script is being made
        self._active = 0  # streams being sent right now
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def in_flight(self) -> int:
        """Streams being sent right now (the request whose script is being made not included)."""
        return self._active

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                t0 = time.perf_counter()
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                hdrs = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        hdrs[k.strip().lower()] = v.strip()
                n = int(hdrs.get("content-length", "0"))
                raw = await reader.readexactly(n) if n else b""
                if method == "GET":
                    await self._send_json(writer, 200, self._get(path))
                    continue
                if served and self.drop_reused > self.dropped:
                    self.dropped += 1
                    await asyncio.sleep(0.05)  # late enough that timing from the first send would show
                    return
                served += 1
                body = json.loads(raw or b"{}")
                self.requests.append(body)
                self.read_at.append(t0)
                entry = {"path": path, "body": body, "read_at": t0, "done_at": None}
                self.log.append(entry)
                self.current_path = path
                script = self.script_fn(body)
                converted = convert_events(script, api_of(path), body)
                if converted is not None:
                    script = replace(script, events=[Event(at, data) for at, data in converted])
                self._active += 1
                try:
                    if not await self._send_script(writer, script, t0):
                        return
                finally:
                    self._active -= 1
                    entry["done_at"] = time.perf_counter()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _get(self, path: str) -> dict:
        if path.startswith("/health"):
            return {"status": "ok"}
        return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "sudu-bench", "max_model_len": 4096}]}

    async def _send_json(self, writer, status: int, obj: dict) -> None:
        payload = json.dumps(obj).encode()
        writer.write(
            f"HTTP/1.1 {status} {_REASONS.get(status, 'X')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
        )
        await writer.drain()

    async def _wait_until(self, t0: float, at_s: float) -> None:
        # asyncio's timers wake up to ~1 ms late (epoll's millisecond timeout); with one stream in
        # flight the last stretch is slept with time.sleep (GIL released, accurate to tens of us). With
        # several, blocking the loop would delay the others, so they get asyncio's precision.
        target = t0 + at_s
        delay = target - time.perf_counter()
        if self._active > 1:
            if delay > 0:
                await asyncio.sleep(delay)
            return
        if delay > _FINE_WAIT_S:
            await asyncio.sleep(delay - _FINE_WAIT_S)
        while (left := target - time.perf_counter()) > 0:
            time.sleep(min(left, 100e-6))

    async def _send_script(self, writer: asyncio.StreamWriter, s: ScriptedResponse, t0: float) -> bool:
        sent: list[float] = []
        self.sent_at_s.append(sent)
        await self._wait_until(t0, s.headers_at_s)
        if s.body is not None or s.status != 200:
            payload = s.body or b'{"error": {"message": "scripted error"}}'
            writer.write(
                f"HTTP/1.1 {s.status} {_REASONS.get(s.status, 'X')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
            )
            await writer.drain()
            return True
        extra = "".join(f"{k}: {v}\r\n" for k, v in s.headers.items())
        out = bytearray(
            f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n{extra}"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        for ev in s.events:
            if t0 + ev.at_s > time.perf_counter():
                if out:
                    writer.write(bytes(out))
                    out.clear()
                await self._wait_until(t0, ev.at_s)
            sent.append(time.perf_counter() - t0)
            out += _http_chunk(_encode(ev.data))
        if s.abort_after_events:
            if out:
                writer.write(bytes(out))
            await writer.drain()
            writer.transport.abort()
            return False
        out += b"0\r\n\r\n"
        writer.write(bytes(out))
        await writer.drain()
        return True

    def start(self) -> "FakeServer":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, self.host, self.port, backlog=1024)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="sudu-bench-fake-server", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            self._server.close()
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(5)

    def __enter__(self) -> "FakeServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LoadLatency:
    """A script with a known load -> latency curve: with `a` requests in flight (this one included),
    TTFT = ttft_s + ttft_slope_s * max(0, a - knee) and each of `tokens` tokens follows after
    itl_s + itl_slope_s * max(0, a - knee). Give it its server: `model.server = srv`."""

    def __init__(self, ttft_s: float = 0.01, ttft_slope_s: float = 0.01, itl_s: float = 0.002,
                 itl_slope_s: float = 0.0, knee: int = 4, tokens: int = 8):
        self.ttft_s, self.ttft_slope_s, self.itl_s, self.itl_slope_s = ttft_s, ttft_slope_s, itl_s, itl_slope_s
        self.knee, self.tokens = knee, tokens
        self.server: FakeServer | None = None

    def latency(self, load: int) -> tuple[float, float]:
        over = max(0, load - self.knee)
        return self.ttft_s + self.ttft_slope_s * over, self.itl_s + self.itl_slope_s * over

    def __call__(self, body: dict) -> ScriptedResponse:
        load = (self.server.in_flight if self.server else 0) + 1
        ttft, itl = self.latency(load)
        pieces = [(ttft + i * itl, f" w{i}") for i in range(self.tokens)]
        usage = {"prompt_tokens": 10, "completion_tokens": self.tokens, "total_tokens": 10 + self.tokens}
        return chat_script(pieces, usage=usage, model=body.get("model", "fake"))


async def serve_forever(host: str, port: int, num_chunks: int) -> None:
    # one answer, its events encoded once: the server should cost the client-overhead run little CPU
    answer = instant_script({"model": "fake"}, num_chunks)
    answer.events = [Event(e.at_s, _encode(e.data)) for e in answer.events]
    srv = FakeServer(lambda body: answer, host, port)
    server = await asyncio.start_server(srv._handle, host, port, backlog=4096)
    print(f"fake OpenAI server on http://{host}:{server.sockets[0].getsockname()[1]}/v1", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="An instant fake OpenAI chat server (for client-overhead runs).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8999)
    p.add_argument("--chunks", type=int, default=8, help="content chunks per answer")
    args = p.parse_args(argv)
    try:
        asyncio.run(serve_forever(args.host, args.port, args.chunks))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
