"""``tools/bench_serve.py --peer llama.cpp``'s build step: a clear line when
cmake or a C++ compiler is missing, the cache it reuses, and (only with
MSTAR_TEST_LLAMA_CPP=1: minutes on 2 cores) a real build and F32 conversion
of the embedded model that ``llama-server`` loads and answers from."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import _llama_cpp  # noqa: E402


@pytest.fixture()
def fake_tree(tmp_path, monkeypatch):
    """An unpacked source tree in a cache of its own (no download, nothing built)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tree = _llama_cpp.cache_dir() / "llama_cpp_python-0.0.1"
    (tree / "vendor" / "llama.cpp").mkdir(parents=True)
    (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").write_text("")
    return tree


def test_missing_cmake_or_compiler_is_one_clear_line(fake_tree, monkeypatch):
    assert _llama_cpp.source_tree() == fake_tree
    monkeypatch.setattr(_llama_cpp.shutil, "which", lambda name: None if name == "cmake" else f"/usr/bin/{name}")
    with pytest.raises(_llama_cpp.PeerUnavailable, match="cmake not found on PATH"):
        _llama_cpp.server_binary()
    monkeypatch.setattr(_llama_cpp.shutil, "which", lambda name: "/usr/bin/cmake" if name == "cmake" else None)
    with pytest.raises(_llama_cpp.PeerUnavailable, match=r"a C\+\+ compiler \(c\+\+, g\+\+ or clang\+\+\) not found"):
        _llama_cpp.server_binary()


def test_a_built_server_is_reused(fake_tree, monkeypatch):
    binary = fake_tree / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    monkeypatch.setattr(_llama_cpp, "_run", lambda *a, **k: pytest.fail("rebuilt a cached llama-server"))
    assert _llama_cpp.server_binary() == binary


def test_a_failed_step_names_it_with_the_output_tail(tmp_path):
    with pytest.raises(_llama_cpp.PeerUnavailable, match="configuring failed .exit 3.:\nboom"):
        _llama_cpp._run([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], "configuring")


@pytest.mark.skipif(os.environ.get("MSTAR_TEST_LLAMA_CPP") != "1", reason="builds llama.cpp: set MSTAR_TEST_LLAMA_CPP=1")
def test_build_convert_and_serve_the_embedded_model():
    import json
    import urllib.request

    from _peer import LlamaServer

    from mstar_actors.fetch import embedded_folder, is_fetched

    if not is_fetched("smollm2"):  # llama.cpp's converter knows its tokenizer (not a random tiny one)
        pytest.skip("the embedded model is not fetched: python -m mstar_actors fetch smollm2")
    gguf = _llama_cpp.f32_gguf(embedded_folder("smollm2"))
    assert gguf.stat().st_size > 0
    server = LlamaServer(gguf, threads=1, num_slots=1)
    try:
        url = server.wait()
        body = json.dumps({"prompt": "hello", "n_predict": 4}).encode()
        with urllib.request.urlopen(urllib.request.Request(url.removesuffix("/v1") + "/completion", body)) as r:
            assert json.loads(r.read())["tokens_predicted"] == 4
    finally:
        server.stop()
