"""``bench_serve.py --peer llama.cpp``: our server against llama.cpp's ``llama-server``
at the same precision, on the fixed workload (``--num-prompts`` chat prompts, default 12,
exactly ``--max-tokens`` new tokens each with ``ignore_eos``, streaming), at each
``--concurrency``.

Systems: ours float32 against an F32 GGUF converted from the same folder by
llama.cpp's ``convert_hf_to_gguf.py``; ours int4 (``model.quantization: int4``,
float activations) and int4_a8 (int8 activations, llama.cpp's own arithmetic;
AVX2 CPUs) against the embedded package's own Q4_1 GGUF (embedded model only). Each
server runs alone; ``--rounds`` rounds go through every system in turn, and
the table gives each figure's median over the rounds with the ratios of ours
to llama.cpp's (targets: concurrency 1 >= 1.0x, 8 >= 1.5x). Every request
opens its own connection, for both servers (llama-server closes a streamed one).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import _llama_cpp
from _common import (
    READY_POLL_S, READY_TIMEOUT_S, free_port, model_dir_of, progress, stop_with_parent, write_output,
)

TARGETS = {1: 1.0, 8: 1.5}  # ours / llama.cpp tokens per second, at that concurrency


class LlamaServer:
    """``llama-server`` on one GGUF, ready once ``GET /health`` answers 200."""

    def __init__(self, gguf: Path, threads: int, num_slots: int):
        self.port = free_port()
        self.log: list[str] = []
        cmd = _llama_cpp.server_command(_llama_cpp.server_binary(), gguf, self.port, threads, num_slots, 1024)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=stop_with_parent(), start_new_session=True)
        threading.Thread(target=self.log.extend, args=(self.proc.stderr,), daemon=True).start()

    def wait(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({self.proc.returncode}):\n{''.join(self.log[-30:])}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return f"http://127.0.0.1:{self.port}/v1"
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(READY_POLL_S)
        raise SystemExit(f"llama-server was not ready within {READY_TIMEOUT_S} s")

    def cpu_s(self) -> float:
        import psutil

        return sum(psutil.Process(self.proc.pid).cpu_times()[:2])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def systems(model_dir: Path, is_embedded: bool) -> list[tuple[str, str, object]]:
    """(name, precision, how to start it): ours and llama.cpp's per precision."""
    out = [("ours float32", "float32", "none"), ("llama.cpp F32", "float32", _llama_cpp.f32_gguf(model_dir))]
    if is_embedded:
        from mstar_actors.fetch import EMBEDDED
        from mstar_actors.models.cpu_quant import has_dot_kernel

        spec = EMBEDDED["smollm2"]
        q4 = Path(importlib.util.find_spec(spec.module).submodule_search_locations[0]) / spec.gguf_file
        out += [("ours int4", "int4", "int4")]
        if has_dot_kernel():
            out.append(("ours int4_a8", "int4", "int4_a8"))
        out.append(("llama.cpp Q4_1", "int4", q4))
    return out


def run_peer(args) -> int:
    from bench_serve import Workload, for_model, make_messages, run_server_load

    model_dir = model_dir_of(args.model)
    name = "smollm2" if not args.model else model_dir.name
    levels = list(args.concurrency)  # bench_serve's --concurrency: already a list of positive counts
    workload = Workload("fixed", make_messages(args.num_prompts or 12), args.max_tokens, True)
    _llama_cpp.server_binary()  # built (or found) before any timing
    entries = systems(model_dir, is_embedded=not args.model)
    print(f"model {model_dir}, threads {args.threads}, cpu count {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f}, {len(workload.prompts)} prompts x {args.max_tokens} tokens, "
          f"{args.rounds} rounds", flush=True)
    figures: dict[tuple[str, int], list] = {}
    for round_ in range(args.rounds):
        for label, _, how in entries:
            progress(f"round {round_ + 1}: {label}")
            with tempfile.TemporaryDirectory() as tmp:
                if isinstance(how, Path):
                    server = LlamaServer(how, args.threads, max(levels))
                else:
                    server = for_model(model_dir, name, max(levels), args.threads, Path(tmp), quantization=how,
                                       async_scheduling=args.async_scheduling)
                try:
                    url = server.wait()
                    for c in levels:
                        r = asyncio.run(run_server_load(url, name, workload, c, server, fresh_connections=True))
                        figures.setdefault((label, c), []).append(r)
                finally:
                    server.stop()
    table = report(entries, levels, figures)
    print(table)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    write_output(table, args.output)
    return 0


def report(entries, levels, figures) -> str:
    def med(label, c, what):
        return statistics.median(what(r) for r in figures[(label, c)])

    tps = lambda r: r.tokens_per_s  # noqa: E731
    head = " ".join(f"{'c=' + str(c) + ' tok/s':>12} {'TTFT ms':>8} {'CPU ms/tok':>10}" for c in levels)
    lines = [f"\n{'server':<18} {head}   (medians; tok/s of each round)"]
    for label, _, _ in entries:
        cells = []
        for c in levels:
            ttft = med(label, c, lambda r: statistics.median(r.ttft_s)) * 1000
            cpu = med(label, c, lambda r: r.cpu_s / r.num_tokens * 1000)
            cells.append(f"{med(label, c, tps):>12.1f} {ttft:>8.0f} {cpu:>10.1f}")
        rounds = " / ".join(",".join(f"{tps(r):.0f}" for r in figures[(label, c)]) for c in levels)
        lines.append(f"{label:<18} {' '.join(cells)}   ({rounds})")
    peers = {precision: label for label, precision, _ in entries if label.startswith("llama.cpp")}
    for ours, precision, _ in entries:
        if ours.startswith("llama.cpp"):
            continue
        peer = peers[precision]
        for c in levels:
            ratio = med(ours, c, tps) / med(peer, c, tps)
            target = TARGETS.get(c)
            verdict = "" if target is None else f" (target >= {target:.1f}x: {'met' if ratio >= target else 'NOT met'})"
            lines.append(f"{precision} c={c}: {ours} / {peer} = {ratio:.2f}x{verdict}")
    return "\n".join(lines)
