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


def test_roofline_pairs_each_format_with_a_bandwidth_measurement(tiny_model_dirs):
    from sudu.commands.roofline import bytes_per_token
    from sudu.weights.loader import load_checkpoint

    model = str(tiny_model_dirs["llama"])
    r = sudu("roofline", model, "--formats", "int8,native", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    ckpt = load_checkpoint(model, progress=False)
    cfg = ckpt.config
    rows = [line for line in r.stdout.splitlines() if "int8" in line or "native" in line]
    assert len(rows) == 2, r.stdout
    for line, fmt in zip(rows, ("int8", "native")):
        cells = [c.strip() for c in line.replace("│", "|").split("|") if c.strip()]
        fmt_cell, mb, bw, limit, achieved, fraction = cells
        assert fmt_cell == fmt and mb == f"{bytes_per_token(cfg, fmt, ckpt) / 1e6:.0f}"
        assert float(bw) > 0 and float(achieved) > 0 and fraction.endswith("%")
        # the limit is this row's own bandwidth over the bytes per token
        assert abs(float(limit) - float(bw) * 1e9 / bytes_per_token(cfg, fmt, ckpt)) <= 0.05 * float(limit) + 0.1
