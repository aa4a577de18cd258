"""The embedded default target: with no --url, sudu bench starts `python -m sudu.cli serve` on a free
port, waits for GET /health (200 once the model is loaded) with a timeout and a progress line, runs the
suite against it and stops it, whatever happens in between."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable

import httpx

from sudu.errors import SuduError

HEALTH_POLL_S = 0.5
STOP_GRACE_S = 15.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, model: str | None, extra: str = "") -> list[str]:
    cmd = [sys.executable, "-m", "sudu.cli", "serve", "--port", str(port)]
    if model:
        cmd += ["--model", model]
    return cmd + shlex.split(extra)


def _log_note(path: str | None, lines: int = 15) -> str:
    """The tail of the server's log, for an error message."""
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            return f"; log {path}:\n" + "".join(f.readlines()[-lines:]).strip()
    except OSError:
        return f"; log {path} unreadable"


def wait_for_health(proc: subprocess.Popen, root_url: str, timeout_s: float, log_path: str | None = None,
                    name: str = "sudu serve") -> float:
    """Seconds until GET /health answered 200; SuduError if the server exits or the timeout passes."""
    from rich.console import Console

    t0 = time.perf_counter()
    console = Console(stderr=True)
    with console.status(f"starting {name}") as status, httpx.Client(timeout=5.0) as client:
        while True:
            elapsed = time.perf_counter() - t0
            if proc.poll() is not None:
                raise SuduError(f"{name} exited with code {proc.returncode} before it was ready{_log_note(log_path)}")
            try:
                if client.get(f"{root_url}/health").status_code == 200:
                    return elapsed
            except httpx.HTTPError:
                pass
            if elapsed > timeout_s:
                raise SuduError(
                    f"{name} was not healthy after {timeout_s:.0f} s (raise --server-timeout){_log_note(log_path)}"
                )
            status.update(f"waiting for {name} to get ready ({elapsed:.0f} s / {timeout_s:.0f} s)")
            time.sleep(HEALTH_POLL_S)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_with_local_server(args, run: Callable[[object], int]) -> int:
    """Run `run(args)` against args.url, or, with no URL, against a local `sudu serve` started here
    (args.url and args.local_server are set for the suite and its report)."""
    if getattr(args, "url", None):
        return run(args)
    port = free_port()
    cmd = serve_command(port, getattr(args, "model", None), getattr(args, "serve_args", ""))
    out_dir = getattr(args, "out", None)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir or tempfile.gettempdir(), f"sudu-serve-{port}.log")
    root = f"http://127.0.0.1:{port}"

    def start() -> tuple[subprocess.Popen, float]:
        with open(log_path, "a") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        try:
            return p, wait_for_health(p, root, args.server_timeout, log_path)
        except BaseException:  # never healthy (or Ctrl-C while waiting): the server is not left running
            stop_server(p)
            raise

    proc = None
    try:
        proc, ready_s = start()
        args.url = root
        args.local_server = {"command": cmd, "log": log_path, "ready_after_s": ready_s, "restarts": []}

        def restart() -> None:
            """Stop the server (SIGTERM, as an operator would) and start it again on the same port."""
            nonlocal proc
            t0 = time.perf_counter()
            stop_server(proc)
            proc, ready = start()
            args.local_server["restarts"].append({"ready_after_s": ready, "total_s": time.perf_counter() - t0})

        args.restart_server = restart
        return run(args)
    finally:
        if proc is not None:
            stop_server(proc)
