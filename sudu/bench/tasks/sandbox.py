"""Run untrusted Python (a model's answer) in a subprocess: its own temp directory, isolated mode
(-I: no user site, no PYTHONPATH), a memory limit set by the harness and a wall-clock timeout after which
the whole process group is killed, so an infinite loop costs the timeout and nothing more."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from sudu.bench.tasks import CheckResult

MEMORY_LIMIT_BYTES = 1 << 30

HARNESS_PRELUDE = f"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT_BYTES}, {MEMORY_LIMIT_BYTES}))
except (ImportError, ValueError, OSError):
    pass
"""


@dataclass
class RunResult:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    timed_out: bool


def run_python(candidate: str, harness: str, timeout_s: float = 10.0) -> RunResult:
    """Write `candidate` as candidate.py and run `harness` (which imports it) in a fresh interpreter."""
    with tempfile.TemporaryDirectory(prefix="sudu-bench-task-") as tmp:
        with open(os.path.join(tmp, "candidate.py"), "w") as f:
            f.write(candidate)
        with open(os.path.join(tmp, "harness.py"), "w") as f:
            f.write(HARNESS_PRELUDE + harness)
        proc = subprocess.Popen(
            [sys.executable, "-I", "harness.py"],
            cwd=tmp,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
            return RunResult(proc.returncode, out, err, False)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return RunResult(None, out, err, True)


def failure_detail(res: RunResult, timeout_s: float) -> str:
    if res.timed_out:
        return f"timed out after {timeout_s:g} s"
    lines = [ln for ln in (res.stderr or res.stdout).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else f"exit code {res.returncode}"


def check_by_running(candidate: str, harness: str, timeout_s: float, pass_detail: str) -> CheckResult:
    """Passes when the harness exits 0 and prints OK last; otherwise the failure's last line."""
    res = run_python(candidate, harness, timeout_s)
    if res.returncode == 0 and res.stdout.strip().endswith("OK"):
        return CheckResult(True, pass_detail)
    return CheckResult(False, failure_detail(res, timeout_s))
