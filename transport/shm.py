"""Shared-memory plumbing: segment names, attach/unlink, wakeup FIFOs, fences,
and cleanup of everything a run left behind.

Naming: every segment of a run is called ``mstar-<run_id>-<name>`` so that
``cleanup_run(run_id)`` can unlink them by prefix. The wakeup FIFOs live in
``<run_dir>/fifo/``. ``register_run`` writes ``<run_dir>/transport.json``
with the launcher's pid and start time; ``cleanup_stale(runs_root)`` reads
those files at the next start and cleans up every run whose launcher is gone
(a ``kill -9`` of the launcher leaves its segments behind otherwise).

The resource tracker: on Python 3.11/3.12 ``SharedMemory(create=False)``
registers the segment with ``multiprocessing.resource_tracker``, which then
unlinks it (and warns about a "leak") when the attaching process exits, even
though another process owns it; ``track=False`` exists only from 3.13. The
usual workaround, unregistering after attaching, races when several processes
attach one segment (the spawned children share one tracker, whose set of names
then sees two unregisters for one register and prints a traceback). So we do
what ``SharedMemory`` does underneath on Linux, without the tracker: open
``/dev/shm/<name>`` and ``mmap`` it. The segments' lifetime is the run's
(``cleanup_run``), never a process's.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import platform
import stat
import threading
from pathlib import Path
from typing import Callable

import psutil

SHM_DIR = Path("/dev/shm")
PREFIX = "mstar-"
MARKER = "transport.json"


# -- names -------------------------------------------------------------------


def run_prefix(run_id: str) -> str:
    """The name prefix of every segment of run ``run_id``."""
    if not run_id or "/" in run_id or "-" in run_id:
        raise ValueError(f"run id {run_id!r}: use a non-empty name without '/' or '-'")
    return f"{PREFIX}{run_id}-"


def segment_name(run_id: str, name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"segment {name!r}: use a non-empty name without '/'")
    return run_prefix(run_id) + name


def fifo_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "fifo"


# -- segments ----------------------------------------------------------------


class Segment:
    """A mapped shared-memory segment: ``buf`` is a writable memoryview."""

    def __init__(self, name: str, fd: int):
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def close(self) -> bool:
        """Unmap. False when views into it are still alive: the mapping then
        stays until they are garbage (never an error at shutdown)."""
        try:
            self.buf.release()
            self._mmap.close()
            return True
        except BufferError:
            return False


def create_segment(name: str, size: int) -> Segment:
    """A new zero-filled segment, owned by the caller's run (see module doc)."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise FileExistsError(
            f"shared memory {name!r} exists already: a run id was reused; "
            f"call transport.cleanup_run or pick a new run id"
        ) from None
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        unlink_segment(name)
        raise
    return Segment(name, fd)


def attach_segment(name: str) -> Segment:
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared memory {name!r} does not exist: the launcher creates it "
            f"(create_ring / create_arena) before its readers and writers open it"
        ) from None
    return Segment(name, fd)


def unlink_segment(name: str) -> None:
    """Remove a segment's name; idempotent. Mappings stay valid."""
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass


# -- wakeup FIFOs -------------------------------------------------------------


def make_fifo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a FIFO") from None


def open_fifo(path: str | os.PathLike) -> int:
    """Open a wakeup FIFO for both reading and writing without blocking:
    O_RDWR never waits for a peer and never sees EOF."""
    try:
        return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"wakeup FIFO {path} is missing: was the run directory removed?") from None


def poke(fd: int) -> None:
    """Write one wakeup byte. A full pipe already holds a pending wakeup."""
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass


def drain(fd: int) -> None:
    """Consume every pending wakeup byte."""
    try:
        while len(os.read(fd, 4096)) == 4096:
            pass
    except BlockingIOError:
        pass


def open_pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits; None when the
    process is already gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


# -- memory fence ---------------------------------------------------------------

_FENCE_CODE = {
    "x86_64": b"\x0f\xae\xf0\xc3",  # mfence; ret
    "aarch64": (0xD5033BBF).to_bytes(4, "little") + (0xD65F03C0).to_bytes(4, "little"),  # dmb ish; ret
}
_FENCE_LOCK = threading.Lock()


def _make_fence():
    """A full memory barrier callable from Python (about 150 ns).

    CPython has no atomics. We map a two-instruction function (``mfence; ret``
    or ``dmb ish; ret``) and call it through ctypes without releasing the GIL.
    Where executable memory is refused, a lock round trip is the fallback: on
    x86-64 its LOCK-prefixed instruction is a full barrier too.
    """
    code = _FENCE_CODE.get(platform.machine())
    if code is None:
        return _lock_fence
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, PermissionError):
        return _lock_fence
    page.write(code)
    func = ctypes.PYFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    func._page = page  # keep the code mapped as long as the function lives
    func()
    return func


def _lock_fence() -> None:
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


fence = _make_fence()
# Stores through a memoryview are plain stores; x86-64 (TSO) keeps them in
# program order as seen by other cores, aarch64 does not: publication there
# needs a barrier too. Hot paths test the flag (cheaper than a no-op call).
NEEDS_PUBLISH_FENCE = platform.machine() != "x86_64"


def publish_fence() -> None:
    """The barrier before publishing a counter or flag (no-op on x86-64)."""
    if NEEDS_PUBLISH_FENCE:
        fence()


# -- run ownership and cleanup ---------------------------------------------------


def register_run(run_dir: str | os.PathLike, run_id: str) -> None:
    """Mark ``run_dir`` as owned by this process (the launcher); idempotent."""
    path = Path(run_dir) / MARKER
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    marker = {"run_id": run_id, "launcher_pid": me.pid, "launcher_start": me.create_time()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(marker))
    os.replace(tmp, path)


def cleanup_run(run_id: str, run_dir: str | os.PathLike | None = None) -> list[str]:
    """Unlink every segment of ``run_id`` (and its FIFOs when ``run_dir`` is
    given). Returns the names removed. Safe to call twice."""
    prefix = run_prefix(run_id)
    removed = []
    for entry in _list_shm():
        if entry.startswith(prefix):
            unlink_segment(entry)
            removed.append(entry)
    if run_dir is not None:
        _remove_fifos(Path(run_dir))
    return removed


def cleanup_stale(runs_root: str | os.PathLike) -> list[str]:
    """Clean up every run under ``runs_root`` whose launcher has died; call it
    at start-up. Returns the run ids cleaned."""
    cleaned = []
    for marker in sorted(Path(runs_root).glob(f"*/{MARKER}")):
        info = _read_marker(marker)
        if info is None or _is_alive(info["launcher_pid"], info["launcher_start"]):
            continue
        cleanup_run(info["run_id"], marker.parent)
        marker.unlink(missing_ok=True)
        cleaned.append(info["run_id"])
    return cleaned


def cleanup_orphans(is_dead_run: Callable[[str], bool]) -> list[str]:
    """Unlink segments of runs whose run directory is gone (a test's temporary
    folder, another runtime dir) and that ``is_dead_run(run_id)`` declares
    dead; ``cleanup_stale`` can't see those. Returns the run ids cleaned."""
    cleaned: set[str] = set()
    for name in _list_shm():
        if not name.startswith(PREFIX):
            continue
        run_id = name[len(PREFIX):].split("-", 1)[0]
        if run_id in cleaned or is_dead_run(run_id):
            _unlink_quietly(name)
            cleaned.add(run_id)
    return sorted(cleaned)


def _unlink_quietly(name: str) -> None:
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass  # another start cleaned it first


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # half-written by a launcher killed mid-start: no segments yet


def _is_alive(pid: int, start_time: float) -> bool:
    """True when ``pid`` runs and is the same process (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        # A zombie has exited (its parent has not reaped it yet): its run is dead.
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - start_time) < 0.01
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _list_shm() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []


def _remove_fifos(run_dir: Path) -> None:
    directory = fifo_dir(run_dir)
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        path.unlink(missing_ok=True)
    try:
        directory.rmdir()
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.ENOENT):
            raise
