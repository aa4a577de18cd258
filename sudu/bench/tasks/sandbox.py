"""Running a model's code (untrusted: any endpoint may return anything) on the benchmarking machine.

Two processes, never one:
- the **checker** is sudu's own code, in the bench process: it makes the test inputs (fresh random ones
  for every check), computes the expected answers itself and decides pass or fail. It never imports or
  executes the candidate's code;
- the **worker** is a fresh Python inside a bubblewrap sandbox. A small driver imports the candidate and
  answers the checker's calls (JSON lines: {"id": nonce, "call": ...} -> {"id": nonce, "result": ...}).
  Whatever the candidate prints, forges or exits with is data at most: a pass needs the right answers to
  inputs it only sees when the call arrives, and each reply must echo the call's random id.

The sandbox (`bwrap`): new user, PID, network, IPC, UTS and cgroup namespaces (no network at all, not
even loopback to the host), the system directories and the interpreter's prefix read-only, nothing else
of the host's file system (no home, no /etc, no /work), a private /tmp, the candidate's own temp
directory the only writable place, environment cleared, killed with its parent. As root it runs as
`nobody` so that the process limit applies (the kernel never limits root's process count). Limits set
before exec, and a failure to set one refuses the run: address space, processes, file size, open
files, CPU time, no core files. A wall-clock timeout kills the whole sandbox.

Without a working bubblewrap the code is not run at all: the check fails with the reason, and
`sudu bench tasks` refuses code-executing tasks up front (`sandbox_problem()`).
"""
from __future__ import annotations

import functools
import json
import os
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

MEMORY_LIMIT_BYTES = 1 << 30
MAX_PROCESSES = 16  # for the sandbox user; threads count too
MAX_FILE_BYTES = 16 << 20
MAX_OPEN_FILES = 64
NOBODY = 65534
INTERPRETERS = ("/usr/bin/python3", "/usr/local/bin/python3")  # tried after sys.executable

DRIVER = r'''
import json, os, sys, traceback
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's folder out
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # the candidate's prints go to stderr, not into the reply channel
def reply(msg):
    out.write(json.dumps(msg) + "\n")
try:
    import candidate
except BaseException as exc:
    reply({"id": None, "error": "import failed: " + "".join(traceback.format_exception_only(type(exc), exc)).strip()})
    raise SystemExit(1)
reply({"id": None, "ready": True})
for line in sys.stdin:
    req = json.loads(line)
    try:
        reply({"id": req["id"], "result": CALLS[req["call"]](candidate, *req.get("args", []))})
    except BaseException as exc:
        reply({"id": req["id"], "error": "".join(traceback.format_exception_only(type(exc), exc)).strip()[-300:]})
'''


@dataclass
class CallResult:
    ok: bool
    result: object = None
    error: str = ""
    elapsed_s: float = 0.0  # measured by the checker, not by the candidate


def _nobody() -> bool:
    return os.geteuid() == 0


def _user_process_count() -> int:
    uid, count = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                count += os.stat(f"/proc/{pid}").st_uid == uid
            except OSError:
                pass
    return count


def _limits(cpu_s: int) -> None:
    """preexec_fn: the limits, then (as root) the switch to nobody. Any failure raises, and Popen
    raises with it: the run is refused instead of running without limits."""
    nproc = MAX_PROCESSES if _nobody() else _user_process_count() + MAX_PROCESSES
    for which, value in ((resource.RLIMIT_AS, MEMORY_LIMIT_BYTES), (resource.RLIMIT_NPROC, nproc),
                         (resource.RLIMIT_FSIZE, MAX_FILE_BYTES), (resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
                         (resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))
        if resource.getrlimit(which) != (value, value):
            raise OSError(f"limit {which} did not apply")
    if _nobody():
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _bwrap_args(bwrap: str, python: str, workdir: str) -> list[str]:
    prefix = os.path.realpath(os.path.join(os.path.dirname(os.path.realpath(python)), ".."))
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work", "--setenv", "PYTHONHASHSEED", "0"]
    for path in ("/usr", "/lib", "/lib64", "/bin", "/sbin"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    if not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", workdir, "/work", "--chdir", "/work"]
    return args + [python, "-I", "-u", "driver.py"]


def _candidate_interpreters() -> list[str]:
    return list(dict.fromkeys([sys.executable] + [p for p in INTERPRETERS if os.access(p, os.X_OK)]))


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[str | None, str]:
    """(interpreter that runs inside the sandbox, "") or (None, why not)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    why = ""
    for python in _candidate_interpreters():
        with tempfile.TemporaryDirectory(prefix="sudu-sandbox-probe-") as tmp:
            os.chmod(tmp, 0o777)
            with open(os.path.join(tmp, "driver.py"), "w") as f:
                f.write("import asyncio, json, os\nos.listdir('/work')\nprint('sandbox-ok')\n")
            try:
                res = subprocess.run(_bwrap_args(bwrap, python, tmp), capture_output=True, text=True, timeout=30,
                                     preexec_fn=lambda: _limits(30))
            except (OSError, subprocess.SubprocessError) as exc:
                why = f"{type(exc).__name__}: {exc}"
                continue
            if res.returncode == 0 and res.stdout.strip() == "sandbox-ok":
                return python, ""
            why = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
    return None, f"bubblewrap cannot run Python here ({why})"


def sandbox_problem() -> str | None:
    """None when untrusted code can be run contained here; else why not (then it is never run)."""
    return _probe()[1] or None


class Worker:
    """A sandboxed Python that has imported the candidate and answers calls until closed. `calls` is
    Python source defining CALLS = {name: fn(candidate, *args)}: the driver's only entry points."""

    def __init__(self, candidate: str, calls: str, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self._buf = b""
        python, why = _probe()
        if python is None:
            raise SandboxUnavailable(why)
        self._tmp = tempfile.TemporaryDirectory(prefix="sudu-bench-task-")
        workdir = self._tmp.name
        os.chmod(workdir, 0o777)  # the sandbox user (nobody, as root) writes here and nowhere else
        with open(os.path.join(workdir, "candidate.py"), "w") as f:
            f.write(candidate)
        with open(os.path.join(workdir, "driver.py"), "w") as f:
            f.write(calls + "\n" + DRIVER)
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(_bwrap_args(shutil.which("bwrap"), python, workdir), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, start_new_session=True,
                                     preexec_fn=lambda: _limits(int(timeout_s) + 1))

    def _line(self) -> bytes | None:
        """The next line from the worker, or None at its exit or the deadline."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
            if len(self._buf) > MAX_FILE_BYTES:
                return None
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _message(self, want_id) -> dict | None:
        while (line := self._line()) is not None:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("id") == want_id:
                return msg
        return None

    def start(self) -> CallResult:
        msg = self._message(None)
        if msg is None:
            return CallResult(False, error=self.failure("the candidate did not load"))
        if "error" in msg:
            return CallResult(False, error=msg["error"])
        return CallResult(True)

    def call(self, name: str, *args) -> CallResult:
        nonce = secrets.token_hex(16)
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write((json.dumps({"id": nonce, "call": name, "args": list(args)}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return CallResult(False, error=self.failure(f"the candidate exited before {name}"))
        msg = self._message(nonce)
        elapsed = time.perf_counter() - t0
        if msg is None:
            return CallResult(False, error=self.failure(f"no answer to {name}"), elapsed_s=elapsed)
        if "error" in msg:
            return CallResult(False, error=str(msg["error"]), elapsed_s=elapsed)
        return CallResult(True, result=msg.get("result"), elapsed_s=elapsed)

    def failure(self, what: str) -> str:
        if time.monotonic() >= self.deadline:
            return f"{what}: timed out after {self.timeout_s:g} s"
        self.close()
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        return f"{what}: " + (lines[-1][:300] if lines else f"exit code {self.proc.returncode}")

    def close(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # bwrap's PID namespace takes every descendant with it
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()
        self._stderr.close()
        self._tmp.cleanup()


class SandboxUnavailable(Exception):
    pass


def run_calls(candidate: str, calls: str, timeout_s: float, requests: list[tuple]) -> tuple[list[CallResult], str | None]:
    """Load the candidate in a sandboxed worker and make `requests` [(name, *args)] in order, within
    `timeout_s` in all. Returns (the results so far, None or why the run stopped)."""
    problem = sandbox_problem()
    if problem:
        return [], f"not run: no sandbox for untrusted code ({problem})"
    try:
        worker = Worker(candidate, calls, timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        return [], f"refused: the sandbox could not start with its limits ({exc})"
    with worker:
        started = worker.start()
        if not started.ok:
            return [], started.error
        results = []
        for name, *args in requests:
            res = worker.call(name, *args)
            if not res.ok:
                return results, res.error
            results.append(res)
    return results, None
