"""Native CPU kernels, compiled on first use.

`load()` returns the compiled extension (bindings.cpp: quant_linear.cpp's quantized linear layers,
attention.cpp's attention over the paged KV pool, ops.cpp's elementwise decoder steps, latent.cpp's MLA
products, decoder.cpp's decode-step stack), or None when it cannot be used: `SUDU_NO_EXT=1`, a CPU without
AVX2/FMA, or a failed compile. Callers then take the PyTorch path; a failure is reported once as a one-line
warning, never raised, because the extension is a speed lever, not a requirement. With
`SUDU_REQUIRE_NATIVE=1` (CI sets it: .ci/run) a failed compile raises instead, so a green run cannot hide a
default CPU path that went untested. The build is cached under $SUDU_HOME/torch_extensions so only the first
process pays the ~30-60 s compile.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import threading
import warnings
from pathlib import Path

from sudu.paths import sudu_home

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in (
    "bindings.cpp", "quant_linear.cpp", "act_quant.cpp", "gguf_tiles.cpp", "amx_tiles.cpp", "attention.cpp",
    "attention_tiles.cpp", "ops.cpp", "latent.cpp", "decoder.cpp", "moe.cpp", "bounded_head.cpp")]
_lock = threading.Lock()
_state: dict[str, object] = {}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def cpu_has_vnni() -> bool:
    """Whether the extension's kernels take their AVX-512 VNNI path (quant_linear.cpp cpu_has_vnni: the same
    features)."""
    return {"avx512_vnni", "avx512vl", "avx512bw", "avx512dq"} <= cpu_flags()


def _headers_sha() -> str:
    digest = hashlib.sha256()
    for header in sorted(Path(__file__).parent.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    return sudu_home() / "torch_extensions" / "sudu_kernels"


def disabled_reason() -> str | None:
    if os.environ.get("SUDU_NO_EXT", "") not in ("", "0"):
        return "SUDU_NO_EXT is set"
    if not _cpu_has_avx2_fma():
        return "this CPU lacks AVX2/FMA/F16C"
    return None


def native_required() -> bool:
    """Whether a failed compile is an error (`SUDU_REQUIRE_NATIVE=1`) rather than a fallback."""
    return os.environ.get("SUDU_REQUIRE_NATIVE", "") not in ("", "0")


def load():
    """The compiled extension module, or None (see the module docstring). Decided once per process: the
    attention and rotary layers call this on every step."""
    if "module" in _state:
        return _state["module"]
    if "error" in _state:
        raise _state["error"]
    reason = disabled_reason()
    if reason is not None:
        return None
    with _lock:
        if "module" not in _state:
            _state["module"] = _compile()
        return _state["module"]


def _compile():
    try:
        from torch.utils.cpp_extension import load as load_extension

        path = build_dir()
        path.mkdir(parents=True, exist_ok=True)
        with _build_lock(path):
            if not any(path.glob("*.so")):
                # a long operation: say so (once per machine; later processes load the cached build)
                print(f"sudu: compiling the native kernels into {path} (once, ~30-60 s)...", flush=True)
            return load_extension(
                name="sudu_kernels",
                sources=[str(p) for p in _SOURCES],
                # No -march=native: the cached build must run on any AVX2 machine that shares $SUDU_HOME.
                # the headers' hash as a define: torch rebuilds when sources or flags change, not headers
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", f"-DSUDU_HEADERS_SHA={_headers_sha()}"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(path),
                verbose=False,
            )
    except Exception as exc:  # any compiler/linker failure: fall back, say so once
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if native_required():
            _state["error"] = RuntimeError(f"sudu: the native kernels failed to compile and SUDU_REQUIRE_NATIVE "
                                           f"is set ({first_line[:200]})")
            raise _state["error"] from exc
        warnings.warn(f"sudu: native quantized kernels unavailable, using PyTorch kernels ({first_line[:200]})",
                      stacklevel=3)
        return None


@contextlib.contextmanager
def _build_lock(path: Path):
    """Every sudu process loads or builds the extension holding an flock on the build directory, which the
    OS releases when a process dies however it dies. torch's own lock is a plain file that a process killed
    mid-build leaves behind (say `sudu serve` stopped while it compiles), after which every later load waits
    for it forever; under the flock any such file is stale, so it is removed."""
    with open(path / ".sudu-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = path / "lock"
            if stale.exists():
                log.warning("removing a stale build lock left by an interrupted build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def options(**changes):
    """The quantized products' options (kernels.h KernelOptions: vnni, amx, amx_min_rows, unpack_min_rows,
    bypass_min_rows, contiguous_shares, fused_silu, attention512) changed for the block and restored after it, yielding the extension.
    Every option computes the same values; tests and benchmarks compare the routes."""
    ext = load()
    if ext is None:
        raise RuntimeError(f"the native kernels are not loaded ({disabled_reason() or 'the compile failed'})")
    before = ext.kernel_options()
    changed = ext.kernel_options()
    for name, value in changes.items():
        if not hasattr(changed, name):
            raise ValueError(f"no kernel option {name!r}")
        setattr(changed, name, value)
    ext.set_kernel_options(changed)
    try:
        yield ext
    finally:
        ext.set_kernel_options(before)

