"""Graceful drain of `sudu serve` (a subprocess, as a container runtime runs it): on SIGTERM the server
stops admitting (new requests get 503 with Retry-After, /health 503) while the request in flight
finishes whole, then it exits 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from sudu.bench.local_server import free_port


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(tiny_model_dirs):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # each engine step slowed down, so the request in flight surely outlives the signal
    script = (
        "import sys, time\n"
        "import sudu.engine.llm_engine as m\n"
        "step = m.LLMEngine.step\n"
        "m.LLMEngine.step = lambda self: (time.sleep(0.05), step(self))[1]\n"
        "from sudu.cli import main\n"
        f"sys.argv = ['sudu', 'serve', {str(tiny_model_dirs['qwen2'])!r}, '--port', '{port}', '--max-model-len',"
        " '128', '--drain-timeout', '60', '--log-level', 'warning']\n"
        "sys.exit(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=os.getcwd()),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=30).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
            time.sleep(0.05)

        events: list = []
        first_token = threading.Event()

        def in_flight() -> None:
            body = {"prompt": "hello", "max_tokens": 80, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        first_token.set()

        client = threading.Thread(target=in_flight)
        client.start()
        assert first_token.wait(60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=30).status_code != 503:  # the drain has begun
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "new", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert int(refused.headers["retry-after"]) >= 1
        assert client.is_alive()  # refused while the first request was still streaming
        client.join(120)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if "error" not in e]
        assert len(chunks) == len(events) - 1  # no error event: it finished, not failed
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) >= 1
        assert chunks[-1].get("usage") is None or chunks[-1]["usage"]["completion_tokens"] == 80
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
