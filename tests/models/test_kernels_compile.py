"""Every kind of Triton kernel launch the suite's interpreter tests made
(``tests/kernel_launches.py``) compiles for an H200 (CUDA, sm_90) here,
without a GPU, through Triton's whole pipeline, machine code included; and
each half-precision kind in bfloat16 too, the GPU's serving dtype. The
interpreter runs a kernel's Python; Triton's compiler refuses more (a
loop-carried name that changes type, a branch whose variables differ), and
that is otherwise first seen on a GPU, as a server whose graphs fail to
capture at start. ``conftest.py`` runs this module last; run alone, it
compiles the launches of the few ops it calls itself.

    python tests/models/test_kernels_compile.py LAUNCHES.json    # compile, one JSON line of results
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def compile_one(launch: dict) -> str:
    """"ok", or what the compiler said (run without the interpreter)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    names = list(launch["signature"])
    source = ASTSource(fn=kernel, signature=launch["signature"],
                       constexprs={(names.index(k),): v for k, v in launch["constants"].items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": launch["num_warps"]})
    except Exception as err:  # the compiler's refusal is the result
        return f"{type(err).__name__}: {err}"[-2000:]
    return "ok" if compiled.asm.get("cubin") else "no machine code"


def with_bfloat16(launches: list[dict]) -> list[dict]:
    """``launches`` and, for each with float16 pointers, the same in bfloat16."""
    out = list(launches)
    for launch in launches:
        if any(kind == "*fp16" for kind in launch["signature"].values()):
            signature = {k: "*bf16" if v == "*fp16" else v for k, v in launch["signature"].items()}
            out.append({**launch, "signature": signature})
    return out


def run_ops_that_fold() -> None:
    """The folded expands of silu_mul and Qwen3.5's convolution on a few rows,
    so that their kernels are recorded however this module is run."""
    from mstar_actors.models import deltanet_decode, triton_fused

    from .test_deltanet_decode import conv_case
    from .test_triton_fused import pending_expand

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        gate_up = torch.randn(3, 64, generator=gen).to(dtype)
        out, expand = pending_expand(gate_up, [32, 32], [1, 0, 2])
        assert triton_fused.silu_mul(out[:, :64], expand=expand) is not None
        proj, weight, conv = conv_case(gen, 3, 48, 40, dtype, slots=6)
        out, expand = pending_expand(proj, [16, 16, 16, 32, 4, 4], [1, 0, 2])
        slots, context_lens = torch.arange(1, 4), torch.tensor([1, 5, 9], dtype=torch.int32)
        assert deltanet_decode.conv_step(out[:, :88], weight, conv, slots, context_lens, expand) is not None


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[tuple[dict, str]]:
    triton = pytest.importorskip("triton")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no CUDA backend to compile for")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the launches are recorded from Triton's interpreter; on a GPU the kernels compile as they run")
    import kernel_launches  # tests/, on the path under pytest (not in the compiling child)

    run_ops_that_fold()
    launches = with_bfloat16(list(kernel_launches.LAUNCHES.values()))
    path = tmp_path_factory.mktemp("launches") / "launches.json"
    path.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return list(zip(launches, json.loads(run.stdout.strip().splitlines()[-1])))


def test_every_recorded_kernel_launch_compiles_for_an_h200(results):
    import kernel_launches

    failed = [f"{launch['module']}.{launch['name']} {launch['signature']} {launch['constants']}: {said}"
              for launch, said in results if said != "ok"]
    assert not failed, f"{len(failed)} of {len(results)} launches do not compile:\n" + "\n\n".join(failed)
    assert {"_silu_mul_kernel", "_conv_step_kernel"} <= {launch["name"] for launch, _ in results}
    assert not kernel_launches.UNRECORDED, f"launches the recorder cannot describe: {kernel_launches.UNRECORDED}"


if __name__ == "__main__":
    todo = json.loads(Path(sys.argv[1]).read_text())
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        print(json.dumps(list(pool.map(compile_one, todo))))
