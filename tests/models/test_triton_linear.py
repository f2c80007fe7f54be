"""The decode-sized Triton GEMM (``triton_linear``) against the product in float32.

On CPU the kernel runs in Triton's interpreter (float16: the interpreter's
``tl.dot`` takes no bfloat16); the ``gpu`` tests run it compiled, eager and
in a CUDA graph, beside cuBLAS.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mstar_actors.models import decoder, triton_linear


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("rows, n, k, config, bias", [
    (1, 40, 64, (16, 32, 2, 4), False),   # split over the inputs, a ragged last output tile
    (3, 70, 96, (16, 32, 4, 4), True),    # four splits, the last one reading only padding
    (8, 33, 128, (32, 64, 1, 4), True),   # one split: no workspace, the bias added at once
    (5, 16, 200, (16, 64, 4, 4), False),  # inputs not a multiple of the tile
    (2, 40, 200, (16, 32, 7, 4), True),   # seven splits (not a power of two), the last one short
    (24, 40, 64, (16, 32, 2, 4), True),   # a tile of 32 rows
    (32, 20, 64, (16, 32, 2, 4), False),  # a tile of 32 rows
    (64, 24, 96, (16, 32, 2, 4), True),   # the most rows it takes
])
def test_kernel_matches_the_float32_product(rows, n, k, config, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).half()
    w = torch.randn(n, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    got = triton_linear.launch(x, w, b, config)
    want = reference(x, w, b)
    assert got.dtype == torch.float16 and got.shape == (rows, n)
    # float32 sums of exact half products, one rounding to half at the end
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-2)
    again = triton_linear.launch(x, w, b, config)
    assert torch.equal(got, again), "a second call (the counters reset by the first) gives the same bits"
    parts, counts = triton_linear._workspace.get(x.device, 1, n, 1)
    assert not counts.any(), "every tile's last program zeroes its counter"


def test_rows_are_independent_of_their_neighbours():
    """A row's result is the same alone as beside other rows (a step's size
    never changes a token's logits)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 96, generator=gen).half()
    w = torch.randn(48, 96, generator=gen).half()
    config = (16, 32, 2, 4)
    together = triton_linear.launch(x, w, None, config)
    for i in range(6):
        assert torch.equal(triton_linear.launch(x[i:i + 1], w, None, config)[0], together[i])


def test_linear_takes_only_decode_sized_cuda_half_steps():
    w = torch.randn(8, 16).half()
    assert triton_linear.linear(torch.randn(2, 16).half(), w) is None, "CPU tensors stay on torch"
    assert not triton_linear.takes(torch.randn(2, 16), w.float()), "float32 stays on the vendor GEMM"
    # the decoder's linear falls back to F.linear wherever the kernel does not take the call
    x = torch.randn(3, 16)
    assert torch.equal(decoder.linear(x, w.float()), F.linear(x, w.float()))


def test_pick_spreads_small_weights_over_the_device():
    """``pick``: 64 x 256 tiles; the split over the inputs whose programs,
    one a multiprocessor at a time (132), end soonest: at most two waves,
    at least 512 inputs a split."""
    assert triton_linear.pick(2048, 8192) == (64, 256, 8, 4)   # Llama-3.2-1B's down: 32 tiles x 8
    assert triton_linear.pick(2048, 2048) == (64, 256, 4, 4)   # its o: 512 inputs a split
    assert triton_linear.pick(3072, 2048) == (64, 256, 4, 4)   # its q|k|v: 48 tiles x 4
    assert triton_linear.pick(16384, 2048) == (64, 256, 1, 4)  # gate|up: 256 tiles already
    assert triton_linear.pick(4096, 14336) == (64, 256, 4, 4)  # Llama-3.1-8B's down: 64 x 4
    assert triton_linear.pick(6144, 4096) == (64, 256, 1, 4)   # its q|k|v: 96 tiles, not split
    # with every LoRA slot's A under the weight: 8B's down with two slots' (65 tiles) still x 4, not
    # left unsplit; 1B's down with four slots' (34 tiles) x 7, as 136 programs would leave 4 to a second wave
    assert triton_linear.pick(4096 + 48, 14336) == (64, 256, 4, 4)
    assert triton_linear.pick(4096 + 48, 4096) == (64, 256, 4, 4)
    assert triton_linear.pick(2048 + 80, 8192) == (64, 256, 7, 4)
    assert triton_linear.pick(2048 + 80, 8192, num_sms=144) == (64, 256, 8, 4)  # on 144: two waves of 136
    # no split whose last programs would read only padding (4,864 inputs in 9: 768 a split, 7 splits' worth)
    for n, k in [(896, 4864), (1184, 3584), (2128, 6144), (2128, 8192), (4144, 14336)]:
        split = triton_linear.pick(n, k)[2]
        per_split = -(-(-(-k // split)) // 256) * 256  # whole tiles of 256 inputs
        assert -(-k // per_split) == split, (n, k, split)
    assert [triton_linear.block_m(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    # past 32 rows the inputs' tile halves, so both tiles' stages fit the shared memory
    assert triton_linear.pick(2048, 8192, 64) == (64, 128, 8, 4)
    assert triton_linear.pick(2048, 8192, 32) == (64, 256, 8, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_kernel_against_cublas(dtype):
    """Compiled, on Llama-3.2-1B's linears and a few rows: within cuBLAS's
    own error of the float32 product, and a CUDA graph's replay equal to the
    eager call bit for bit."""
    gen = torch.Generator().manual_seed(3)
    torch.set_grad_enabled(False)  # as the runner steps (``takes`` refuses autograd)
    try:
        check_against_cublas(dtype, gen)
    finally:
        torch.set_grad_enabled(True)


def check_against_cublas(dtype, gen) -> None:
    # Llama-3.2-1B's linears, q|k|v with four slots' A under it, and down with them (34 tiles: 7 splits)
    for n, k in [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (3312, 2048), (2128, 8192)]:
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).cuda()
        b = torch.randn(n, generator=gen).to(dtype).cuda()
        for rows in sorted({1, 3, triton_linear.MAX_ROWS, 64}):
            x = torch.randn(rows, k, generator=gen).to(dtype).cuda()
            # past MAX_ROWS (cuBLAS's in serving) the tiles of the most rows it takes
            call = triton_linear.linear if rows <= triton_linear.MAX_ROWS else triton_linear.launch
            for bias in (None, b):
                got = call(x, w, bias)
                assert got is not None
                want = reference(x, w, bias)
                err = (got.float() - want).norm() / want.norm()
                vendor = (F.linear(x, w, bias).float() - want).norm() / want.norm()
                assert err <= max(2 * vendor, 1e-3), (n, k, rows, err, vendor)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = call(x, w, bias)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, got)


def test_check_tool_runs_as_a_user_runs_it():
    """``python tools/check_linear_kernels.py`` (its CPU path: the interpreter on tiny shapes) checks every
    shape, ``--chain`` runs a decoder's layers on both GEMMs, and ``--split-sweep`` every split of the
    linears widened by two adapter slots' A rows (the zero slot has none)."""
    root = Path(__file__).resolve().parents[2]
    for argv, said in (([], "# 0 results with more error"), (["--chain", "--rows", "2"], "tiny"),
                       (["--split-sweep", "--max-loras", "2", "--rows", "3"], "tiny qkv 192x64 rows 3 tiles 3")):
        done = subprocess.run([sys.executable, str(root / "tools" / "check_linear_kernels.py"), *argv], cwd=root,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and said in done.stdout, done.stderr[-2000:]
