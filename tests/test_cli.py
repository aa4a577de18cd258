"""The `sudu` command as a user meets it: `generate` streams a completion; bad input is one line on
stderr and a non-zero exit, never a traceback."""
import subprocess
import sys


def sudu(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sudu.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_streams_a_completion(tiny_model_dirs):
    r = sudu("generate", str(tiny_model_dirs["llama"]), "def add(a, b):", "--max-tokens", "6", "--ignore-eos",
             "--stats", "--kv-cache-memory", "8MiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != "" or "6 generated" in r.stderr
    assert "6 generated" in r.stderr and "TTFT" in r.stderr


def test_generate_chat_applies_the_template(tiny_model_dirs):
    r = sudu("generate", str(tiny_model_dirs["llama"]), "hi", "--chat", "--max-tokens", "3", "--kv-cache-memory", "8MiB")
    assert r.returncode == 0, r.stderr


def test_help_lists_every_command():
    r = sudu("--help")
    assert r.returncode == 0
    for cmd in ("serve", "generate", "bench", "models"):
        assert cmd in r.stdout


def test_bad_input_is_one_line_and_nonzero(tiny_model_dirs, tmp_path):
    cases = [
        ("generate", "no-such-model", "x"),
        ("generate", str(tmp_path / "missing.gguf"), "x"),
        ("generate", str(tiny_model_dirs["llama"]), "x", "--temperature", "-1"),
        ("generate", str(tiny_model_dirs["llama"]), "x", "--max-tokens", "100000", "--max-model-len", "64"),
        ("generate", str(tiny_model_dirs["llama"]), "x", "--dtype", "int3"),
    ]
    for args in cases:
        r = sudu(*args)
        assert r.returncode != 0, args
        lines = [line for line in r.stderr.strip().splitlines() if line.startswith("sudu:")]
        assert len(lines) == 1 and "Traceback" not in r.stderr, (args, r.stderr)
