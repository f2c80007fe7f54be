"""llama.cpp's ``llama-server`` as a peer for ``bench_serve.py --peer llama.cpp``.

Built once from the llama.cpp that ``llama-cpp-python``'s source
distribution vendors (``pip download --no-deps``), CMake target
``llama-server``, at most ``nproc`` jobs; cached under the user's cache
folder (``$XDG_CACHE_HOME/mstar-actors/llama.cpp/<version>``) with the F32
GGUFs converted by its ``convert_hf_to_gguf.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from _common import progress

from mstar_actors.fetch import cache_root

PACKAGE = "llama-cpp-python"


class PeerUnavailable(SystemExit):
    """The peer can't be built or run here; the message says why and what to install."""


def cache_dir() -> Path:
    return cache_root().parent / "llama.cpp"


def _run(cmd: list[str], what: str, cwd: Path | None = None, env: dict | None = None) -> None:
    """Run ``cmd``, passing its progress lines (cmake's ``[ 42%] ...``) on; its output's tail on failure."""
    progress(f"llama.cpp: {what}: {' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''}")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line])[-60:]
        if line.startswith("[") and "%]" in line[:8]:
            progress(f"llama.cpp: {line.strip()}")
    if proc.wait() != 0:
        raise PeerUnavailable(f"llama.cpp: {what} failed (exit {proc.returncode}):\n{''.join(tail)}")


def source_tree() -> Path:
    """The unpacked sdist (downloaded once); its ``vendor/llama.cpp`` is what is built."""
    folder = cache_dir()
    found = sorted(folder.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if found:
        return found[-1].parents[2]
    folder.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", str(folder)],
         f"downloading the {PACKAGE} source distribution")
    archives = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise PeerUnavailable(f"llama.cpp: pip left no {PACKAGE} source archive in {folder}")
    progress(f"llama.cpp: unpacking {archives[-1].name}")
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(folder, filter="data")
    archives[-1].unlink()
    return source_tree()


def server_binary() -> Path:
    """``llama-server``, built on first use (cmake, a C++ compiler; minutes on 2 cores)."""
    tree = source_tree()
    build = tree / "build"
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    cmake = shutil.which("cmake")
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cmake is None or compiler is None:
        missing = " and ".join(n for n, w in (("cmake", cmake), ("a C++ compiler (c++, g++ or clang++)", compiler))
                               if w is None)
        raise PeerUnavailable(f"llama.cpp: cannot build llama-server: {missing} not found on PATH "
                              "(install them, e.g. pip install cmake and your system's g++)")
    jobs = str(len(os.sched_getaffinity(0)))
    _run([cmake, "-S", str(tree / "vendor" / "llama.cpp"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
          "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"],
         "configuring")
    _run([cmake, "--build", str(build), "--target", "llama-server", "-j", jobs],
         f"building llama-server with {jobs} jobs (a few minutes)")
    if not binary.is_file():
        raise PeerUnavailable(f"llama.cpp: the build finished but left no {binary}")
    return binary


def f32_gguf(model_dir: Path) -> Path:
    """``model_dir`` converted to an F32 GGUF (once per folder) by llama.cpp's own converter."""
    tree = source_tree() / "vendor" / "llama.cpp"
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:12]  # one per folder
    out = cache_dir() / "gguf" / f"{model_dir.resolve().name}-{key}.f32.gguf"
    if out.is_file():
        return out
    if importlib.util.find_spec("sentencepiece") is None:  # the converter reads Llama vocabularies with it
        raise PeerUnavailable("llama.cpp's convert_hf_to_gguf.py needs sentencepiece: "
                              "pip install -e '.[bench]' (or pip install sentencepiece), then run again")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    tmp = out.with_suffix(".partial")
    _run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
          "--outfile", str(tmp)], f"converting {model_dir.name} to an F32 GGUF", env=env)
    tmp.rename(out)
    return out


def server_command(binary: Path, gguf: Path, port: int, threads: int, num_slots: int, ctx_per_slot: int) -> list[str]:
    """``llama-server`` on ``gguf`` with ``num_slots`` parallel sequences (``-np``) of ``ctx_per_slot`` tokens each.

    ``--no-repack``: no extra weight layouts. On a CPU with AMX the native
    build's AMX path takes Q4_1 weights and crashes (a segfault in
    ``tinygemm_kernel_amx<block_q8_1, block_q4_1>`` on the first matmul, seen
    with llama-cpp-python 0.3.36's llama.cpp); F32 has no such layout, and
    Q4_1 then runs on ggml's AVX-512 dot products."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(num_slots), "-c", str(num_slots * ctx_per_slot), "--no-webui",
            "--no-repack"]
