"""A real server in the test process (LiveServer: uvicorn on a free port in a thread) or in a child
process (`sudu serve` with a patch applied first), and the checks every API test shares: the OpenAI
error shape, SSE events, a streamed chat collected."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

from sudu.server.app import make_server


class LiveServer:
    """uvicorn (sudu's draining server) on a free 127.0.0.1 port in a background thread."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, "127.0.0.1", self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while httpx.get(self.url + "/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("server never became healthy")
            time.sleep(0.05)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, JSON-decoded ([DONE] kept as the string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def collect_stream(stream) -> tuple[str, list[dict], str]:
    """content, tool calls (assembled from their deltas) and finish_reason of a one-choice stream."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert call["id"] is None  # the id and the name come once, first
                call["id"], call["name"] = tc.id, tc.function.name
            call["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def start_patched_sudu_serve(model_dir, port: int, patch: str) -> subprocess.Popen:
    """`sudu serve MODEL_DIR` in a child process after `patch` (Python source: a delay or a fault put into
    the engine) has run there; stdout and stderr together in proc.stdout."""
    script = (
        f"{patch}\n"
        "import sys\n"
        "from sudu.cli import main\n"
        f"sys.argv = ['sudu', 'serve', {str(model_dir)!r}, '--port', '{port}', '--log-level', 'warning']\n"
        "sys.exit(main())\n"
    )
    return subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=os.getcwd()),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextlib.contextmanager
def tiny_engine_server(model_dir, served_model_name: str):
    """`sudu serve`'s app on a real engine over a tiny model, in this process (the agents' tests share it)."""
    from sudu.config import EngineConfig
    from sudu.engine.async_engine import AsyncLLMEngine
    from sudu.server.app import build_app

    config = EngineConfig(model=str(model_dir), max_model_len=2048, max_num_seqs=16, kv_cache_memory=16 << 20)
    engine = AsyncLLMEngine(config, max_queue_len=64)
    with LiveServer(build_app(engine, served_model_name=served_model_name)) as server:
        yield server
