"""Adversarial answers to the code tasks: each one fails or stays contained. A forged "OK" with an early
exit, a write outside the temp directory, a socket connect to the host, a fork bomb and a read of a file
in the home directory; and without a sandbox, untrusted code is not run at all."""
import os
import pathlib
import socket
import time
import uuid

import pytest

from sudu.bench.tasks import build_task
from sudu.bench.tasks import sandbox
from tests.helpers.code_answers import GOOD_PALINDROME, needs_sandbox

GOOD_CODE = GOOD_PALINDROME.split("```python\n")[1].split("```")[0]


def check(code: str):
    return build_task("palindrome", 1024).check(f"```python\n{code}\n```")


def with_prelude(prelude: str) -> str:
    """A correct answer that first runs `prelude` at import time."""
    return prelude + "\n" + GOOD_CODE


@needs_sandbox
def test_correct_answer_passes():
    assert check(GOOD_CODE).passed


@needs_sandbox
def test_forged_ok_with_early_exit_fails():
    forged = ("import os, sys, json\nprint('OK')\nsys.stdout.write(json.dumps({'id': None, 'ready': True}) + '\\n')\n"
              "sys.stdout.flush()\nos._exit(0)\ndef longest_palindrome(s):\n    return ''\n")
    res = check(forged)
    assert not res.passed and ("did not load" in res.detail or "exited" in res.detail or "no answer" in res.detail)


@needs_sandbox
def test_forged_replies_cannot_pass():
    # answers every call with a made-up reply on the real channel: the call's random id is unknown to it
    forged = ("import json, os, sys\nfor _ in range(3):\n"
              "    os.write(1, (json.dumps({'id': None, 'ready': True}) + '\\n').encode())\n"
              "    os.write(1, (json.dumps({'id': 'x', 'result': ['']*60}) + '\\n').encode())\n"
              "os._exit(0)\n")
    assert not check(forged).passed


@needs_sandbox
def test_write_outside_the_temp_dir_is_contained(tmp_path):
    targets = [tmp_path / "pwned", pathlib.Path.home() / f".sudu-pwned-{uuid.uuid4().hex}",
               pathlib.Path(f"/tmp/sudu-pwned-{uuid.uuid4().hex}")]
    prelude = "for p in %r:\n    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n" % [
        str(t) for t in targets]
    res = check(with_prelude(prelude))
    assert res.passed  # the writes failed or went to the sandbox's private /tmp; the answer itself is right
    assert not any(t.exists() for t in targets)


@needs_sandbox
def test_socket_connect_does_not_reach_the_host():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    prelude = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=2).sendall(b'x')\n"
               "    REACHED = True\nexcept OSError:\n    REACHED = False\n") % port
    code = with_prelude(prelude).replace("    return best", "    return best if not REACHED else 'reached'")
    res = check(code)
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()
    assert res.passed  # REACHED stayed False: the connection failed inside the sandbox


@needs_sandbox
def test_fork_bomb_is_contained():
    t0 = time.monotonic()
    res = check(with_prelude("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"))
    assert not res.passed and "timed out" in res.detail
    assert time.monotonic() - t0 < 30
    # every process of the sandbox goes with it (the kernel empties a PID namespace whose init died,
    # asynchronously: allow it a few seconds)
    deadline = time.monotonic() + 10
    while (leftover := [p for p in os.listdir("/proc") if p.isdigit() and _is_sandbox_python(p)]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftover


def _is_sandbox_python(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"driver.py" in f.read()
    except OSError:
        return False


@needs_sandbox
def test_home_directory_is_not_readable():
    secret = pathlib.Path.home() / f".sudu-secret-{uuid.uuid4().hex}"
    secret.write_text("hunter2-" + uuid.uuid4().hex)
    try:
        code = ("def longest_palindrome(s):\n    return open(%r).read()\n") % str(secret)
        res = check(code)
        assert not res.passed and secret.read_text() not in res.detail
        assert "No such file" in res.detail or "Permission" in res.detail
    finally:
        secret.unlink()


@needs_sandbox
def test_limits_are_in_force():
    code = with_prelude("import resource\nLIMITS = [resource.getrlimit(r)[0] for r in "
                        "(resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_FSIZE)]\n")
    code = code.replace("    return best", "    return str(LIMITS) if s == 'babad' else best")
    res = check(code)
    assert not res.passed
    assert f"[{sandbox.MEMORY_LIMIT_BYTES}, " in res.detail and f", {sandbox.MAX_FILE_BYTES}]" in res.detail


def test_no_sandbox_means_not_run(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: "bubblewrap (bwrap) is not installed")
    marker = tmp_path / "ran"
    res = check(with_prelude(f"open({str(marker)!r}, 'w').write('x')\n"))
    assert not res.passed and "not run: no sandbox" in res.detail
    assert not marker.exists()


@needs_sandbox
def test_failed_limit_refuses_the_run(monkeypatch, tmp_path):
    def refuse(which, value):
        raise OSError("not permitted")

    monkeypatch.setattr(sandbox.resource, "setrlimit", refuse)  # the worker's preexec runs this after fork
    marker = tmp_path / "ran"
    res = check(with_prelude(f"open({str(marker)!r}, 'w').write('x')\n"))
    assert not res.passed and "refused" in res.detail and not marker.exists()


def test_ci_fails_rather_than_skips_without_a_sandbox(monkeypatch):
    """needs_sandbox where bubblewrap cannot run: a skip on a developer's machine, a failure under CI."""
    from tests.helpers import code_answers

    monkeypatch.setattr(code_answers, "sandbox_problem", lambda: "bubblewrap (bwrap) is not installed")
    for name in ("CI", "SUDU_REQUIRE_NATIVE"):
        monkeypatch.delenv(name, raising=False)
    def runs_code():
        pass

    assert [m.name for m in code_answers.needs_sandbox(runs_code).pytestmark] == ["skip"]
    for name, value in (("CI", "true"), ("SUDU_REQUIRE_NATIVE", "1")):
        monkeypatch.setenv(name, value)
        with pytest.raises(pytest.fail.Exception, match="CI requires it"):
            code_answers.needs_sandbox(runs_code)()
        monkeypatch.delenv(name)
