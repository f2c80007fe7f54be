"""Check the decode-sized Triton GEMM (``triton_linear``) against cuBLAS, then time both.

Sections:

- check: the relative error (norm) of ours and of ``F.linear`` against the
  product in float32, per weight shape and row count;
- time: device us a call of each, in a CUDA graph of back-to-back calls on
  distinct copies of the weight (together past the L2), and the bandwidth
  that makes of the weight's bytes;
- ``--chain``: a decoder's layers at one shape, each q|k|v, o, gate|up and
  down with the fused RMSNorm and SiLU-and-mul between (``triton_fused``, as
  a step runs them), ms a pass on cuBLAS and on ours: what a decode step's
  GEMMs cost with the kernels around them;
- ``--sweep``: every tile configuration on each shape, the fastest first, to
  check ``triton_linear.pick``;
- ``--split-sweep``: ``pick``'s tiles with every split over the inputs (1
  to 16), to check its split.

``--max-loras N`` widens each decoder linear by its LoRA slots' A rows, as
a served model with ``lora.max_loras: N`` fuses them under the weight
(``LoraStack.fuse_under``: ``--lora-rank`` rows an adapter slot and shard),
which moves the tile counts the split rule reads.

    python tools/check_linear_kernels.py                      # Llama-3.2-1B and 3.1-8B linears, 1 / 8 rows
    python tools/check_linear_kernels.py --chain --rows 1 4 8
    python tools/check_linear_kernels.py --sweep --shapes 1b --rows 1
    python tools/check_linear_kernels.py --split-sweep --max-loras 4 --rows 1 8

Without CUDA it runs Triton's interpreter on tiny shapes (a smoke test of
the script; no timings).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F  # noqa: E402

from mstar_actors import triton_launch  # noqa: E402
from mstar_actors.models import triton_linear  # noqa: E402
from tools._common import non_negative_int, positive_float, positive_int  # noqa: E402
from tools._gpu_timing import capture_graph, cuda_median_us  # noqa: E402

# (name, out, in) of each linear of a layer, fused as the engine fuses them, and the head.
# Shards of each fused linear (its LoRA slots' A rows, ``--max-loras``); the head takes none under it.
SHARDS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1, "lm_head": 0}
SHAPES = {
    "1b": {"hidden": 2048, "layers": 16, "linears": [("qkv", 3072, 2048), ("o", 2048, 2048),
                                                     ("gate_up", 16384, 2048), ("down", 2048, 8192),
                                                     ("lm_head", 49152, 2048)]},
    "8b": {"hidden": 4096, "layers": 32, "linears": [("qkv", 6144, 4096), ("o", 4096, 4096),
                                                     ("gate_up", 28672, 4096), ("down", 4096, 14336),
                                                     ("lm_head", 49152, 4096)]},
    "tiny": {"hidden": 64, "layers": 2, "linears": [("qkv", 96, 64), ("o", 64, 64), ("gate_up", 256, 64),
                                                    ("down", 64, 128), ("lm_head", 200, 64)]},
}
L2_BYTES = 256 << 20  # weights in turn past this, so each call reads its weight from memory


def linears(args, shape: str) -> list[tuple[str, int, int]]:
    """``shape``'s linears, each widened by its slots' A rows where ``--max-loras`` is given."""
    extra = 0 if not args.max_loras else args.max_loras * args.lora_rank
    return [(name, n + SHARDS[name] * extra, k) for name, n, k in SHAPES[shape]["linears"]]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def weights(n: int, k: int, dtype, device: str, copies: int, gen) -> list[torch.Tensor]:
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    return [w] + [w.clone() for _ in range(copies - 1)]


def cases(args, device: str, dtype, seed: int):
    """``(shape, name, n, k, ws, m, x)`` for every linear of ``--shapes`` and
    row count of ``--rows``: the weight (on CUDA in copies that together pass
    the L2, each call then reading its weight from memory) and ``m`` rows."""
    gen = torch.Generator().manual_seed(seed)
    for shape in args.shapes:
        for name, n, k in linears(args, shape):
            copies = 1 if device == "cpu" else max(2, -(-L2_BYTES // (n * k * 2)))
            ws = weights(n, k, dtype, device, copies, gen)
            for m in args.rows:
                yield shape, name, n, k, ws, m, torch.randn(m, k, generator=gen).to(dtype).to(device)


def time_calls(fn_of, ws: list[torch.Tensor], repeats: int) -> float:
    """us a call: ``fn_of(w)`` on each of ``ws`` in turn, in one graph."""
    graph = capture_graph(lambda: [fn_of(w) for w in ws], 1)
    for _ in range(3):
        graph.replay()
    return cuda_median_us(graph.replay, len(ws), repeats)


def check_and_time(args, device: str, dtype) -> int:
    sms = triton_launch.num_sms(torch.device(device), 132)  # as ``launch`` picks
    bad = 0
    print(f"{'shape':<8} {'linear':<8} {'rows':>4} {'err ours':>9} {'err cuBLAS':>10} {'config':>16} "
          f"{'cuBLAS us':>9} {'ours us':>8} {'cuBLAS TB/s':>11} {'ours TB/s':>9} {'ours/cuBLAS':>11}")
    for shape, name, n, k, ws, m, x in cases(args, device, dtype, 0):
        ref = x.float() @ ws[0].float().T
        ours, theirs = triton_linear.launch(x, ws[0]), F.linear(x, ws[0])
        e_ours, e_theirs = rel_err(ours, ref), rel_err(theirs, ref)
        bad += e_ours > max(2 * e_theirs, 1e-2)
        row = f"{shape:<8} {name:<8} {m:>4} {e_ours:>9.2e} {e_theirs:>10.2e} {str(triton_linear.pick(n, k, m, sms)):>16}"
        if device == "cuda":
            t_cublas = time_calls(lambda w: F.linear(x, w), ws, args.repeats)
            t_ours = time_calls(lambda w: triton_linear.launch(x, w), ws, args.repeats)
            tb = n * k * 2 / 1e6
            row += (f" {t_cublas:>9.2f} {t_ours:>8.2f} {tb / t_cublas:>11.2f} {tb / t_ours:>9.2f}"
                    f" {t_ours / t_cublas:>11.2f}")
        print(row, flush=True)
    print(f"# {bad} results with more error than twice cuBLAS's (or 1e-2)")
    return 1 if bad else 0


def fits_shared_memory(m: int, block_n: int, block_k: int) -> bool:
    """Whether the kernel's buffers, four of an x and a weight tile (bf16) as
    Triton allots them, fit the H200's 227 KiB a block."""
    return 4 * (triton_linear.block_m(m) + block_n) * block_k * 2 <= 227 << 10


def sweep(args, device: str, dtype) -> int:
    sms = triton_launch.num_sms(torch.device(device), 132)  # as ``launch`` picks
    for shape, name, n, k, ws, m, x in cases(args, device, dtype, 1):
        base = time_calls(lambda w: F.linear(x, w), ws, args.repeats)
        results = []
        for block_n, block_k, split, warps in itertools.product((16, 32, 64, 128), (64, 128, 256, 512),
                                                                (1, 2, 4, 8, 16), (4, 8)):
            if (split * block_k > max(k, block_k) or block_n * block_k > 64 * 512
                    or not fits_shared_memory(m, block_n, block_k)):
                continue
            config = (block_n, block_k, split, warps)
            results.append((time_calls(lambda w: triton_linear.launch(x, w, config=config), ws, 5), config))
        results.sort()
        picked = triton_linear.pick(n, k, m, sms)
        mine = next((t for t, c in results if c == picked), None)
        best = ", ".join(f"{c} {t:.2f}" for t, c in results[:4])
        print(f"{shape} {name} {n}x{k} rows {m}: cuBLAS {base:.2f} us; pick {picked} "
              f"{'-' if mine is None else f'{mine:.2f}'}; fastest {best}", flush=True)
    return 0


def split_sweep(args, device: str, dtype) -> int:
    """``pick``'s tiles with every split from 1 to 16 (each at least a tile
    of inputs): us a call on CUDA; in Triton's interpreter, splits 1 to 4 of
    the tiny shapes (some reading only padding), each one's error against
    the float32 product (and cuBLAS's)."""
    bad = 0
    sms = triton_launch.num_sms(torch.device(device), 132)  # as ``launch`` picks
    for shape, name, n, k, ws, m, x in cases(args, device, dtype, 2):
        block_n, block_k, picked, warps = triton_linear.pick(n, k, m, sms)
        cells = []
        for split in range(1, 17 if device == "cuda" else 5):
            if device == "cuda" and split > 1 and k // split < block_k:
                break
            config = (block_n, block_k, split, warps)
            if device == "cuda":
                cells.append((time_calls(lambda w: triton_linear.launch(x, w, config=config), ws, args.repeats),
                              split))
            else:
                ref = x.float() @ ws[0].float().T
                err = rel_err(triton_linear.launch(x, ws[0], config=config), ref)
                bad += err > max(2 * rel_err(F.linear(x, ws[0]), ref), 1e-2)
                cells.append((err, split))
        tiles = -(-n // block_n)
        fastest = min(cells)[1]
        print(f"{shape} {name} {n}x{k} rows {m} tiles {tiles}: pick {picked}, "
              f"{'fastest' if device == 'cuda' else 'least error'} {fastest}; "
              + " ".join(f"{split}:{v:.2f}" if device == "cuda" else f"{split}:{v:.1e}" for v, split in cells),
              flush=True)
    if device == "cpu":
        print(f"# {bad} splits with more error than twice cuBLAS's (or 1e-2)")
    return 1 if bad else 0


def chain(args, device: str, dtype) -> int:
    """A decoder's layers, GEMMs and the fused ops between them, on cuBLAS and on ours."""
    from mstar_actors.models import triton_fused

    gen = torch.Generator().manual_seed(2)
    print(f"{'shape':<6} {'rows':>4} {'cuBLAS ms':>9} {'ours ms':>8} {'ours/cuBLAS':>11} {'floor ms':>8}")
    for shape in args.shapes:
        spec = SHAPES[shape]
        hidden, layers = spec["hidden"], spec["layers"]
        linears = {name: (n, k) for name, n, k in spec["linears"]}
        layer_ws = [{name: weights(n, k, dtype, device, 1, gen)[0] for name, (n, k) in linears.items()
                     if name != "lm_head"} for _ in range(layers)]
        head = weights(*linears["lm_head"], dtype, device, 1, gen)[0]
        norm_w = torch.ones(hidden, dtype=dtype, device=device)
        inter = linears["down"][1]
        total_bytes = sum(w.numel() * 2 for lw in layer_ws for w in lw.values()) + head.numel() * 2
        for m in args.rows:
            h0 = torch.randn(m, hidden, generator=gen).to(dtype).to(device)

            def run(lin, h0=h0):
                residual = h0.clone()
                h = triton_fused.rms_norm(h0, norm_w, 1e-6)
                for lw in layer_ws:
                    qkv = lin(h, lw["qkv"])
                    a = triton_fused.rms_norm(qkv[:, :hidden].contiguous(), norm_w, 1e-6)  # attention's stand-in
                    h = triton_fused.rms_norm(lin(a, lw["o"]), norm_w, 1e-6, residual)
                    s = triton_fused.silu_mul(lin(h, lw["gate_up"]))
                    h = triton_fused.rms_norm(lin(s[:, :inter], lw["down"]), norm_w, 1e-6, residual)
                return lin(h, head)

            times = []
            for lin in (F.linear, triton_linear.launch):
                if device == "cpu":
                    run(lin)
                    times.append(float("nan"))
                    continue
                graph = capture_graph(lambda lin=lin: run(lin), 1)
                for _ in range(3):
                    graph.replay()
                times.append(cuda_median_us(graph.replay, 1, args.repeats) / 1e3)
            floor = total_bytes / (args.bandwidth * 1e12) * 1e3
            print(f"{shape:<6} {m:>4} {times[0]:>9.3f} {times[1]:>8.3f} {times[1] / times[0]:>11.2f} {floor:>8.3f}",
                  flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default 1b 8b (tiny without CUDA)")
    p.add_argument("--rows", nargs="+", type=positive_int, default=[1, 8])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--chain", action="store_true", help="time a decoder's layers instead")
    p.add_argument("--sweep", action="store_true", help="time every tile configuration instead")
    p.add_argument("--split-sweep", action="store_true", help="time pick's tiles at every split instead")
    p.add_argument("--max-loras", type=non_negative_int, default=0,
                   help="widen each decoder linear by this many LoRA slots' A rows, as served (default 0: none)")
    p.add_argument("--lora-rank", type=positive_int, default=16,
                   help="A rows a slot and shard with --max-loras (default 16)")
    p.add_argument("--bandwidth", type=positive_float, default=4.24, help="TB/s of the copy, for --chain's floor")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.shapes = args.shapes or (["1b", "8b"] if device == "cuda" else ["tiny"])
    dtype = getattr(torch, args.dtype)
    if device == "cpu":
        dtype = torch.float16  # the interpreter's tl.dot takes no bfloat16
    print(f"# {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}, torch {torch.__version__}, "
          f"{dtype}")
    if args.sweep:
        return sweep(args, device, dtype)
    if args.split_sweep:
        return split_sweep(args, device, dtype)
    if args.chain:
        return chain(args, device, dtype)
    return check_and_time(args, device, dtype)


if __name__ == "__main__":
    raise SystemExit(main())
