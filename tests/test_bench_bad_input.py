"""Every new option's bad input ends `sudu bench` with one clear line on stderr and a non-zero exit, before
any server is started: an unreadable or malformed trace, an unknown price preset, an impossible SLO, an
API a suite cannot use, an unwritable --json-lines file."""
import os
import subprocess
import sys

import pytest

from sudu.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sudu(*argv, cwd):
    """The real command line, in its own process (imports take seconds: used once)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "sudu.cli", "bench", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def sudu_here(argv, cwd, capsys, monkeypatch):
    """sudu.cli.main in this process: (exit code, stderr)."""
    monkeypatch.chdir(cwd)
    code = main(["bench", *argv])
    return code, capsys.readouterr().err


CASES = [
    (["replay", "missing.jsonl"], "cannot read trace missing.jsonl: No such file or directory"),
    (["replay", "bad.jsonl"], "trace bad.jsonl line 2: not JSON"),
    (["replay", "good.jsonl", "--speedup", "0"], "--speedup must be > 0"),
    (["single", "--price", "deepseek-v9"], "unknown price preset 'deepseek-v9'"),
    (["single", "--price", "miss=1,hit=0.1"], "--price needs at least miss=X and out=Z"),
    (["single", "--machine-cost", "-2"], "--machine-cost must be >= 0"),
    (["capacity", "--slo", "ttft=0ms"], "impossible SLO: ttft target must be > 0"),
    (["capacity", "--slo", "ttft=-5ms,itl=10ms"], "impossible SLO: ttft target must be > 0"),
    (["capacity", "--slo", "e2e=1s"], "capacity targets are p99 TTFT and p99 ITL: e2e_s not supported"),
    (["capacity", "--slo", "ttft=1s", "--start", "8", "--max", "4"], "--max >= --start"),
    (["tasks", "--api", "messages", "--tasks", "retrieval"], "the tasks suite needs chat completions"),
    (["single", "--json-lines", "nodir/x.jsonl"], "cannot open --json-lines nodir/x.jsonl"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_one_clear_line(tmp_path, capsys, monkeypatch, argv, message):
    (tmp_path / "bad.jsonl").write_text('{"input_length": 4, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    (tmp_path / "good.jsonl").write_text('{"input_length": 4, "output_length": 1, "hash_ids": [1]}\n')
    # a URL nothing listens on: a check that came after connecting would fail differently
    code, err = sudu_here([*argv, "--url", "http://127.0.0.1:9/v1", "--no-progress"], tmp_path, capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith("sudu: error: ") and message in lines[0], lines[0]


def test_trace_writer_bad_input(tmp_path, capsys, monkeypatch):
    code, err = sudu_here(["trace", "x.jsonl", "--sessions", "0"], tmp_path, capsys, monkeypatch)
    assert code == 1 and err.strip() == "sudu: error: --sessions must be >= 1"


def test_real_command_line(tmp_path):
    r = sudu("replay", "missing.jsonl", "--url", "http://127.0.0.1:9/v1", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "sudu: error: cannot read trace missing.jsonl: No such file or directory"
