"""ik_llama.cpp's `llama-server`, the fastest CPU fork of llama.cpp and a peer of the HTTP side-by-side
benchmarks (`vs_llama_server.py --peer ik_llama.cpp`): find a built binary, or build one from a source
tree of github.com/ikawrakow/ik_llama.cpp.

    python benchmarks/ik_llama.py --build --src DIR [--dir /work/ik-build]   # about 14 minutes on 2 cores

It is not on PyPI, so the source comes from a clone of its repository (or any copy of its tree) given as
--src. It is configured with ggml's native CPU detection: it has no AMX code, so native detection cannot
switch on instructions that trap on these VMs, and its explicit AVX-512 flag set does not compile.

The binary is looked up in $IK_LLAMA_SERVER, then <dir>/src/build/bin/llama-server.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama_server import first_executable  # noqa: E402

DEFAULT_DIR = os.environ.get("IK_LLAMA_BUILD_DIR", "/work/ik-build")
FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON"]


def locate(build_dir: str = DEFAULT_DIR) -> str | None:
    return first_executable(os.environ.get("IK_LLAMA_SERVER"), os.path.join(build_dir, "src", "build", "bin", "llama-server"))


def require(build_dir: str = DEFAULT_DIR) -> str:
    path = locate(build_dir)
    if path is None:
        sys.exit(f"ik_llama.cpp's llama-server not found ($IK_LLAMA_SERVER, {build_dir}/src/build/bin). Build it with:\n"
                 f"  python benchmarks/ik_llama.py --build --src <ik_llama.cpp source tree> --dir {build_dir}")
    return path


def build(src: str, build_dir: str = DEFAULT_DIR) -> str:
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        sys.exit(f"{src}: no CMakeLists.txt (give --src a copy of ik_llama.cpp's source tree)")
    tree = os.path.join(build_dir, "src")
    if os.path.abspath(src) != os.path.abspath(tree):
        os.makedirs(build_dir, exist_ok=True)
        shutil.copytree(src, tree, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", "build"))
    subprocess.run(["cmake", "-B", "build", "-G", "Ninja", *FLAGS], cwd=tree, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "llama-bench", "-j2"], cwd=tree, check=True)
    return require(build_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build it when it is not found")
    parser.add_argument("--src", help="ik_llama.cpp's source tree (a clone of its repository)")
    parser.add_argument("--dir", default=DEFAULT_DIR, help="where it is copied and built")
    args = parser.parse_args()
    path = locate(args.dir)
    if path is None and args.build:
        if not args.src:
            sys.exit("--build needs --src: a copy of ik_llama.cpp's source tree")
        path = build(args.src, args.dir)
    print(path or require(args.dir))


if __name__ == "__main__":
    main()
