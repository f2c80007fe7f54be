"""Audio clips prepared in processes of their own, the bytes in and the
frames out through shared memory.

A clip's decode (PyAV's frame loop) and the feature extractor's steps hold
the GIL most of their 20-30 ms, so the prepare pool's threads would take
turns on them; ``ClipProcesses`` runs each clip in one of N processes while
the calling pool thread waits (the GIL released).

Only small arguments cross the process pool's pipe. A clip's bytes and its
frames travel through a **slot**: a shared-memory segment, its head holding
the frames the process writes, its tail the clip the caller wrote. Through
the pipe, a 10 s 44.1 kHz stereo wav (1.8 MB in, 0.5 MB of frames out) took
about 4 ms of one pipe's time a clip, every clip of every process in turn
through the one call queue, and 2 ms of the feeding process's CPU; through
a slot it is two copies (``tools/bench_prepare.py``'s audio rows).

A slot is taken by one call at a time and goes back after it, so there are
at most as many as calls at once (the pool's threads). A clip bigger than
its slot gets the slot replaced by a bigger one (a new name); a process
keeps one mapping a slot, reopening it when the name changes. Segments are
named ``mstar-<run_id>-clip<P>s<N>-<size>`` (pool P of the process, slot N):
``close`` unlinks them, and after a
crash the launcher's ``cleanup_run`` (or the next start's
``cleanup_stale``) removes them by the run's prefix.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
import threading
from pathlib import Path
from typing import Any

from mstar_actors.prepare.media import MediaError, MediaLimits
from transport import shm

MIN_CLIP_BYTES = 4 << 20  # a slot's room for the clip at first; it grows by doubling
_POOLS = itertools.count()  # one process may run several pools under one run id (the benchmark does)


class ClipSlot:
    """One shared-memory segment: ``frame_bytes`` of frames, then the clip."""

    def __init__(self, index: int, segment: shm.Segment):
        self.index, self.segment = index, segment


class ClipProcesses:
    """``num`` processes, each with its own feature extractor loaded from
    ``model_dir``, started and warmed now so no request waits for an
    interpreter's start. ``prepare`` is ``preparers.prepare_clip`` in one of
    them; call it from several threads at once."""

    def __init__(self, model_dir: Path, num: int, run_id: str, frame_bytes: int):
        self.run_id, self.frame_bytes = run_id, frame_bytes
        self.tag = f"clip{next(_POOLS)}"
        self.executor = concurrent.futures.ProcessPoolExecutor(
            num, mp_context=multiprocessing.get_context("spawn"), initializer=_init_clip_process,
            initargs=(model_dir,))
        self._lock = threading.Lock()
        self._free: list[ClipSlot] = []
        self._all: dict[int, ClipSlot] = {}
        self._indices = itertools.count()
        try:
            for future in [self.executor.submit(_clip_process_ready) for _ in range(num)]:
                future.result()
        except BaseException:
            self.close()
            raise

    def prepare(self, data: bytes, param: str, limits: MediaLimits, sampling_rate: int,
                max_seconds: float) -> tuple[Any, int, int, bytes]:
        """(frames ``[n, mels]`` float32 numpy, valid frames, audio tokens,
        the clip's digest), as ``prepare_clip`` gives them; a refusal is the
        ``MediaError`` naming ``param``."""
        import numpy as np

        slot = self._take(len(data))
        try:
            buf = slot.segment.buf
            buf[self.frame_bytes:self.frame_bytes + len(data)] = data
            result = self.executor.submit(_clip_in_process, slot.index, slot.segment.name, self.frame_bytes,
                                          len(data), param, limits, sampling_rate, max_seconds).result()
            if isinstance(result, str):
                raise MediaError(param, result)
            shape, num_frames, num_tokens, digest = result
            view = np.frombuffer(buf, np.float32, count=shape[0] * shape[1]).reshape(shape)
            rows = view.copy()  # the slot serves the next clip once given back
            del view
        finally:
            self._give_back(slot)
        return rows, num_frames, num_tokens, digest

    def _take(self, clip_bytes: int) -> ClipSlot:
        with self._lock:
            slot = self._free.pop() if self._free else None
            index = slot.index if slot is not None else next(self._indices)
        if slot is not None and slot.segment.size >= self.frame_bytes + clip_bytes:
            return slot
        room = MIN_CLIP_BYTES
        while room < clip_bytes:
            room *= 2
        if slot is not None:  # too small for this clip: a bigger one under a new name
            self._drop(slot)
        size = self.frame_bytes + room
        slot = ClipSlot(index, shm.create_segment(shm.segment_name(self.run_id, f"{self.tag}s{index}-{size}"), size))
        with self._lock:
            self._all[index] = slot
        return slot

    def _give_back(self, slot: ClipSlot) -> None:
        with self._lock:
            self._free.append(slot)

    def _drop(self, slot: ClipSlot) -> None:
        shm.unlink_segment(slot.segment.name)
        slot.segment.close()
        with self._lock:
            self._all.pop(slot.index, None)

    def close(self) -> None:
        """End the processes (a clip being prepared is abandoned) and unlink every slot."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            slots, self._all, self._free = list(self._all.values()), {}, []
        for slot in slots:
            shm.unlink_segment(slot.segment.name)
            slot.segment.close()


# -- in a clip process ----------------------------------------------------------

_EXTRACTOR: Any = None  # this process's feature extractor (``_init_clip_process``)
_SLOTS: dict[int, shm.Segment] = {}  # this process's mapping of each slot it has used


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
    from mstar_actors.prepare.preparers import load_feature_extractor, prepare_clip, silent_wav

    keep_freed_buffers(max_kept=KEPT_BYTES_PER_DRAFT)
    torch.set_num_threads(1)
    _EXTRACTOR = load_feature_extractor(model_dir)
    rate = _EXTRACTOR.sampling_rate
    prepare_clip(_EXTRACTOR, silent_wav(rate, rate // 2), "warm-up", MediaLimits(), rate, 1.0)


def _clip_process_ready() -> bool:
    return _EXTRACTOR is not None


def _slot(index: int, name: str) -> shm.Segment:
    segment = _SLOTS.get(index)
    if segment is None or segment.name != name:
        if segment is not None:
            segment.close()
        segment = _SLOTS[index] = shm.attach_segment(name)
    return segment


def _clip_in_process(index: int, name: str, frame_bytes: int, clip_bytes: int, param: str, limits: MediaLimits,
                     sampling_rate: int, max_seconds: float) -> tuple[tuple[int, int], int, int, bytes] | str:
    """``prepare_clip`` on the clip in slot ``index``, its frames written to the
    slot's head; a refusal comes back as its message (an exception with the
    part's name would not survive the pickle)."""
    import numpy as np

    from mstar_actors.prepare.preparers import prepare_clip

    buf = _slot(index, name).buf
    data = bytes(buf[frame_bytes:frame_bytes + clip_bytes])
    try:
        rows, num_frames, num_tokens, digest = prepare_clip(_EXTRACTOR, data, param, limits, sampling_rate,
                                                            max_seconds)
    except MediaError as err:
        return err.reason
    if rows.nbytes > frame_bytes:
        raise ValueError(f"{rows.nbytes} bytes of frames exceed the slot's {frame_bytes}")
    out = np.frombuffer(buf, np.float32, count=rows.size).reshape(rows.shape)
    out[...] = rows
    del out
    return rows.shape, num_frames, num_tokens, digest
