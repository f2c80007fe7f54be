"""Audio clips prepared in processes of their own, the bytes in and the
frames out through shared memory.

A clip's decode (PyAV's frame loop) and the feature extractor's steps hold
the GIL most of their 20-30 ms, so the prepare pool's threads would take
turns on them; ``ClipProcesses`` runs each clip in one of N processes while
the calling pool thread waits (the GIL released).

**Lanes.** Each process serves ``LANES_PER_PROCESS`` lanes: a pipe of its
own and a **slot**, a shared-memory segment whose head holds the frames the
process writes and whose tail the clip the caller wrote. A call takes a
free lane (on the process with the fewest calls, so the processes fill
evenly), writes the clip into its slot, sends a few numbers down its pipe
and waits for a few numbers back. With two lanes a process, the process
finds its next clip waiting when it finishes one, instead of idling while
the result travels back and the next clip is handed over.

Why not ``concurrent.futures.ProcessPoolExecutor``: its one call queue
carried every clip's bytes and frames through one pipe in turn (a 10 s
44.1 kHz stereo wav: 1.8 MB in and 0.5 MB out, about 4 ms of that pipe's
time a clip, and 2 ms of the feeding process's CPU), and held only one call
beyond those running, refilled by a thread that needs the feeding process's
GIL; and a process that dies breaks the whole pool for good. Here a dead
process fails its calls with a ``MediaError`` naming the part (its clip
may be what killed it) and is started again, and so is one that takes over
``CLIP_TIMEOUT_S`` on a clip.

**Restarts and close never close a pipe under a waiting call**: the process
is killed first, so each call waiting on one of its lanes reads the end of
its own pipe, and only once those calls have given their lanes back are the
pipes closed (and, for a restart, new ones made). A pipe closed under a
waiting call could have its descriptor reused by the new process's pipe,
and the call would then wait on the wrong process. While a process is
restarted no call takes its lanes.

A clip bigger than its slot gets the slot replaced by a bigger one (a new
name); a process keeps one mapping a lane, reopening it when the name
changes. Segments are named ``mstar-<run_id>-clip<P>s<N>-<size>`` (pool P
of the process, lane N): ``close`` unlinks them, and after a crash the
launcher's ``cleanup_run`` (or the next start's ``cleanup_stale``) removes
them by the run's prefix.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.connection
import threading
from pathlib import Path
from typing import Any

from mstar_actors.prepare.media import MediaError, MediaLimits
from transport import shm

MIN_CLIP_BYTES = 4 << 20  # a slot's room for the clip at first; it grows by doubling
LANES_PER_PROCESS = 2
START_TIMEOUT_S = 120.0  # a process's start: an interpreter, torch, av and the extractor
CLOSE_WAIT_S = 5.0  # for the calls under way when the processes are killed at close to read the end
CLIP_TIMEOUT_S = 60.0  # one clip (30 s of audio at most: well under a second); past it the process is restarted
_POOLS = itertools.count()  # one process may run several pools under one run id (the benchmark does)


class ClipTimeout(Exception):
    """No answer within ``CLIP_TIMEOUT_S`` (not ``TimeoutError``: that is an ``OSError``, a broken pipe's kind)."""


class ClipProcess:
    """One process and the parent ends of its lanes' pipes; ``generation``
    counts its starts, ``busy`` the calls on its lanes, and ``restarting``
    keeps new calls off it while it is replaced."""

    def __init__(self, index: int, cpus: list[int] | None):
        self.index, self.cpus, self.generation, self.busy, self.restarting = index, cpus, 0, 0, False
        self.process: Any = None
        self.conns: list[Any] = []

    def start(self, model_dir: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(LANES_PER_PROCESS)]
        process = ctx.Process(target=_serve_clips, args=(model_dir, [child for _, child in pipes], self.cpus),
                              name=f"clip-process-{self.index}", daemon=True)
        try:
            process.start()
        finally:
            for _, child in pipes:
                child.close()
        self.process, self.conns = process, [parent for parent, _ in pipes]
        self.generation += 1

    def wait_ready(self) -> None:
        """The process's first message: ready, or why its start failed."""
        conn = self.conns[0]
        if not conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"a clip process did not start within {START_TIMEOUT_S:g} s")
        try:
            ready = conn.recv()
        except EOFError:
            raise RuntimeError(f"a clip process ended while starting (exit code {self.process.exitcode})") from None
        if ready != "ready":
            raise RuntimeError(f"a clip process could not start: {ready}")

    def kill(self) -> None:
        """End the process now, its pipes left open: a call waiting on one
        reads the end of it (closing a pipe under a waiting call could hand
        its descriptor to the next process's pipe)."""
        if self.process is not None:
            self.process.kill()
            self.process.join()

    def stop(self) -> None:
        """Close the pipes (the process sees every end and returns) and reap it."""
        for conn in self.conns:
            conn.close()
        if self.process is not None:
            self.process.join(2.0)
            if self.process.is_alive():
                self.kill()


class Lane:
    def __init__(self, index: int, process: ClipProcess, conn_index: int):
        self.index, self.process, self.conn_index = index, process, conn_index
        self.segment: shm.Segment | None = None


class ClipProcesses:
    """``num`` processes, each with its own feature extractor loaded from
    ``model_dir``, started and warmed now so no request waits for an
    interpreter's start. ``prepare`` is ``audio_features.prepare_clip`` in one of
    them; call it from several threads at once (a call waits while every
    lane is taken: the prepare pool has as many threads as lanes). Process
    i is pinned to ``cpus[i]`` where given (``CpuPlan.pool_cpus``: a physical
    core each before any core's second hardware thread)."""

    def __init__(self, model_dir: Path, num: int, run_id: str, frame_bytes: int,
                 cpus: list[list[int]] | None = None):
        self.model_dir, self.run_id, self.frame_bytes = model_dir, run_id, frame_bytes
        self.tag = f"clip{next(_POOLS)}"
        self.processes = [ClipProcess(i, cpus[i % len(cpus)] if cpus else None) for i in range(num)]
        self.lanes = [Lane(p.index * LANES_PER_PROCESS + k, p, k) for p in self.processes
                      for k in range(LANES_PER_PROCESS)]
        self._free = list(self.lanes)
        self._changed = threading.Condition()
        self._closed = False
        try:
            for p in self.processes:
                p.start(model_dir)
            for p in self.processes:
                p.wait_ready()
        except BaseException:
            self.close()
            raise

    def prepare(self, data: bytes, param: str, limits: MediaLimits, sampling_rate: int,
                max_seconds: float) -> tuple[Any, int, int, bytes]:
        """(frames ``[n, mels]`` float32 numpy, valid frames, audio tokens,
        the clip's digest), as ``prepare_clip`` gives them; a refusal is the
        ``MediaError`` naming ``param``."""
        import numpy as np

        lane, generation = self._take()
        try:
            segment = self._slot(lane, len(data))
            segment.buf[self.frame_bytes:self.frame_bytes + len(data)] = data
            conn = lane.process.conns[lane.conn_index]
            try:
                conn.send((lane.index, segment.name, self.frame_bytes, len(data), param, limits, sampling_rate,
                           max_seconds))
                result = _receive(conn)
            except ClipTimeout:
                self._restart(lane.process, generation)  # stops the process, and the clip with it
                raise MediaError(param, f"preparing this audio took over {CLIP_TIMEOUT_S:g} s and was stopped; "
                                        f"send a shorter clip or another format") from None
            except (EOFError, OSError):
                self._restart(lane.process, generation)
                raise MediaError(param, "the process preparing this audio ended while it was decoded (its file "
                                        "may be what ended it); send the audio again, or as another format") from None
            kind, value = result
            if kind == "refused":
                raise MediaError(param, value)
            if kind == "error":
                raise RuntimeError(value)
            shape, num_frames, num_tokens, digest = value
            view = np.frombuffer(segment.buf, np.float32, count=shape[0] * shape[1]).reshape(shape)
            rows = view.copy()  # the slot serves the lane's next clip
            del view
        finally:
            self._give_back(lane)
        return rows, num_frames, num_tokens, digest

    def _take(self) -> tuple[Lane, int]:
        """A free lane of a process not being restarted, the least busy
        first, and that process's generation. No restart can finish while
        the lane is held (it waits for its process's other calls), so the
        lane's pipe stays the one of that generation until ``_give_back``."""
        with self._changed:
            while True:
                if self._closed:
                    raise RuntimeError("the clip processes are closed (the server is stopping)")
                free = [ln for ln in self._free if not ln.process.restarting]
                if free:
                    break
                self._changed.wait()
            lane = min(free, key=lambda ln: ln.process.busy)
            self._free.remove(lane)
            lane.process.busy += 1
            return lane, lane.process.generation

    def _give_back(self, lane: Lane) -> None:
        with self._changed:
            lane.process.busy -= 1
            self._free.append(lane)
            self._changed.notify_all()  # a caller waiting for a lane, or a restart for its process's calls

    def _slot(self, lane: Lane, clip_bytes: int) -> shm.Segment:
        """The lane's segment, replaced by a bigger one when the clip does not fit."""
        if lane.segment is not None and lane.segment.size >= self.frame_bytes + clip_bytes:
            return lane.segment
        room = MIN_CLIP_BYTES
        while room < clip_bytes:
            room *= 2
        size = self.frame_bytes + room
        with self._changed:  # never a new segment once ``close`` has unlinked them
            if self._closed:
                raise RuntimeError("the clip processes are closed (the server is stopping)")
            if lane.segment is not None:
                shm.unlink_segment(lane.segment.name)
                lane.segment.close()
            lane.segment = shm.create_segment(shm.segment_name(self.run_id, f"{self.tag}s{lane.index}-{size}"),
                                              size)
            return lane.segment

    def _restart(self, process: ClipProcess, generation: int) -> None:
        """Replace ``process`` (the caller holds one of its lanes) unless a
        call that saw it end does so already, or it is the same no more, or
        the pool is closing. It is killed first, its pipes left open, so a
        call on its other lane reads the end and gives its lane back; once
        the caller's is the only call left, it is started again."""
        with self._changed:
            if self._closed or process.restarting or process.generation != generation:
                return
            process.restarting = True
            try:
                process.kill()
                self._changed.wait_for(lambda: process.busy == 1 or self._closed)
                if self._closed:
                    return
                process.stop()
                process.start(self.model_dir)  # its first message, "ready", waits in lane 0's pipe
            finally:
                process.restarting = False
                self._changed.notify_all()

    def close(self) -> None:
        """End the processes (a clip being prepared fails: killed, its pipes
        left open until its call has read the end) and unlink every slot;
        calls after this raise."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        for process in self.processes:
            process.kill()
        with self._changed:
            self._changed.wait_for(lambda: all(p.busy == 0 for p in self.processes), timeout=CLOSE_WAIT_S)
        for process in self.processes:
            process.stop()
        for lane in self.lanes:
            if lane.segment is not None:
                shm.unlink_segment(lane.segment.name)
                lane.segment.close()  # the mapping stays while a call still writes to it


def _receive(conn: Any) -> tuple[str, Any]:
    """A clip's answer, past a restarted process's first message ("ready",
    which comes before the answer to the clip sent after the restart);
    ``ClipTimeout`` after ``CLIP_TIMEOUT_S`` without one (a decoder stuck
    on a file holds no thread forever)."""
    while True:
        if not conn.poll(CLIP_TIMEOUT_S):
            raise ClipTimeout
        result = conn.recv()
        if not isinstance(result, str):
            return result
        if result != "ready":
            raise RuntimeError(f"a clip process could not start: {result}")


# -- in a clip process ----------------------------------------------------------

_EXTRACTOR: Any = None  # this process's feature extractor (``_init_clip_process``)
_SLOTS: dict[int, shm.Segment] = {}  # this process's mapping of each lane's slot


def _serve_clips(model_dir: Path, conns: list[Any], cpus: list[int] | None) -> None:
    """A clip process: pinned to ``cpus`` (where the host lets it), started,
    saying so on the first lane, then answering each lane's clips in turn
    until the parent closes every pipe."""
    import contextlib
    import os

    if cpus:
        with contextlib.suppress(OSError):  # unpinned, it still prepares clips
            os.sched_setaffinity(0, cpus)
    try:
        _init_clip_process(model_dir)
    except Exception as err:
        conns[0].send(f"{type(err).__name__}: {err}")
        return
    conns[0].send("ready")
    conns = list(conns)
    while conns:
        for conn in multiprocessing.connection.wait(conns):
            try:
                call = conn.recv()
            except (EOFError, OSError):
                conns.remove(conn)
                continue
            try:
                result: tuple[str, Any] = _clip_in_process(*call)
            except MediaError as err:
                result = ("refused", err.reason)
            except Exception as err:
                result = ("error", f"{type(err).__name__}: {err}")
            try:
                conn.send(result)
            except (EOFError, OSError):
                conns.remove(conn)


def _init_clip_process(model_dir: Path) -> None:
    """A clip process's start: freed buffers kept for the next clip (as the
    prepare actor keeps them, ``keep_freed_buffers``: else each clip's
    decoded samples and spectrogram fault their pages in again, 10-15% of
    an mp3 clip's time), one intra-op thread, its extractor, and one short
    clip prepared, so the first request's clip finds the decoder and the
    feature code imported and warm (a second or more at the first clip)."""
    global _EXTRACTOR
    import torch

    from mstar_actors.prepare.media import KEPT_BYTES_PER_DRAFT, keep_freed_buffers
    from mstar_actors.prepare.audio_features import load_feature_extractor, prepare_clip, silent_wav

    keep_freed_buffers(max_kept=KEPT_BYTES_PER_DRAFT)
    torch.set_num_threads(1)
    _EXTRACTOR = load_feature_extractor(model_dir)
    rate = _EXTRACTOR.sampling_rate
    prepare_clip(_EXTRACTOR, silent_wav(rate, rate // 2), "warm-up", MediaLimits(), rate, 1.0)


def _slot(index: int, name: str) -> shm.Segment:
    segment = _SLOTS.get(index)
    if segment is None or segment.name != name:
        if segment is not None:
            segment.close()
        segment = _SLOTS[index] = shm.attach_segment(name)
    return segment


def _clip_in_process(index: int, name: str, frame_bytes: int, clip_bytes: int, param: str, limits: MediaLimits,
                     sampling_rate: int, max_seconds: float) -> tuple[str, Any]:
    """``prepare_clip`` on the clip in lane ``index``'s slot, its frames
    written to the slot's head: ("done", (shape, frames, tokens, digest))."""
    import numpy as np

    from mstar_actors.prepare.audio_features import prepare_clip

    buf = _slot(index, name).buf
    data = bytes(buf[frame_bytes:frame_bytes + clip_bytes])
    rows, num_frames, num_tokens, digest = prepare_clip(_EXTRACTOR, data, param, limits, sampling_rate, max_seconds)
    if rows.nbytes > frame_bytes:
        raise ValueError(f"{rows.nbytes} bytes of frames exceed the slot's {frame_bytes}")
    out = np.frombuffer(buf, np.float32, count=rows.size).reshape(rows.shape)
    out[...] = rows
    del out
    return "done", (rows.shape, num_frames, num_tokens, digest)
