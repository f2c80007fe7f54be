"""The adapter-reader actor: adapter folders in, validated host copies out.

On ``ReadAdapter(name, path)`` it reads and validates the folder with
``read_adapter`` against the base model's shapes (``ModelInfo.lora_base``),
in a thread (the loop stays free; it never touches a device), writes the host copy (``adapter_to_bytes``)
into a new shared-memory segment of the run, and answers ``AdapterRead``
with the digest and ``AdapterHostRef`` (``segment`` is the full shared-memory
name for ``transport.shm.attach_segment``), or ``AdapterReadFailed`` with the
reason. ``DropAdapter`` releases one hold (see ``mstar_actors.lora.host_tier``
for the tier's rules: least recently used, never a held copy).

Reads run one at a time, in arrival order, so answers come back in the order
the conductor asked (it matches them first in, first out).

Which files a read may open: a runtime load's (any path not configured in
``lora.adapters``) only files that really lie inside ``lora.adapter_dirs``,
checked on each opened file (``read_adapter(allowed_dirs=...)``), so a
folder of links to an adapter elsewhere, or a config linked to any JSON
file, is refused (``AdapterReadFailed`` code ``adapter_path_not_allowed``,
a 403 naming the file, not where it led). Configured adapters are the
operator's and are read where their links lead, as vLLM applies its
allowed folders to runtime loads only: a Hugging Face cache snapshot's
files are links into the cache's ``blobs/``.

Segments are named ``mstar-<run_id>-adapter<N>``: ``stop()`` unlinks them,
and after a crash the launcher's ``cleanup_run`` (or the next start's
``cleanup_stale``) removes them by the run's prefix.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

from actors.base import Actor
from mstar_actors.lora.host_tier import HostEntry, HostTier
from mstar_actors.messages import AdapterHostRef, AdapterRead, AdapterReadFailed, DropAdapter, ReadAdapter
from transport import shm


def file_signature(path: str) -> tuple:
    """(size, mtime_ns) of the folder's files: a cached copy of changed files is stale."""
    sig = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            st = (Path(path) / name).stat()
            sig.append((name, st.st_size, st.st_mtime_ns))
        except OSError:
            sig.append((name, None, None))
    return tuple(sig)


class AdapterReaderActor(Actor):
    """inbox: ``conductor`` (ConductorToAdapterReader), ``control``; outbox: ``conductor``, ``control``."""

    def __init__(self, *, run_id: str | None = None, **kw: Any):
        super().__init__(**kw)
        import torch

        from mstar_actors import rundir

        self.run_id = run_id or rundir.new_run_id()  # tests: an id of their own
        self.tier = HostTier(self.config.lora.max_cpu_loras)
        self._counter = itertools.count()
        # Host copies are kept in the ranks' dtype: a bf16 copy of a float32 file
        # is half the bytes each install maps and copies, and the install converts nothing.
        self.host_dtype = getattr(torch, self.info.dtype)

    async def start(self) -> None:
        if self.info.lora_base is None:
            # An architecture without LoRA shape rules still serves its base weights
            # (Qwen2.5-VL has rules: its text stack); configured adapters were refused
            # by the launcher already, a runtime load is refused with this reason.
            self.log.info("adapters can't be read for this model: %s", self.info.lora_refusal)

    async def stop(self) -> None:
        for entry in list(self.tier.entries.values()):
            shm.unlink_segment(entry.segment)
        self.tier.entries.clear()

    async def handle(self, channel: str, msg: Any) -> None:
        match msg:
            case ReadAdapter():
                await self.outbox["conductor"].send(await self.read(msg))
            case DropAdapter(name=name, digest=digest):
                self.unlink(self.tier.release(name, digest))
            case _:
                self.unknown(channel, msg)

    async def read(self, msg: ReadAdapter) -> AdapterRead | AdapterReadFailed:
        signature = file_signature(msg.path)
        entry = None if msg.refresh else self.tier.lookup(msg.name, msg.path, signature)
        if entry is None:
            try:
                entry = await self.run_blocking(self._read_into_segment, msg, signature)
            except Exception as err:  # AdapterError names the module and reason; anything else is a bad file too
                self.log.warning("adapter %r at %s refused: %s", msg.name, msg.path, err)
                return AdapterReadFailed(name=msg.name, path=msg.path, message=_reason(err), code=_code(err))
        self.unlink(self.tier.hold(entry))
        entry = self.tier.find(entry.name, entry.digest)
        host = AdapterHostRef(segment=entry.segment, nbytes=entry.nbytes)
        return AdapterRead(name=msg.name, path=msg.path, digest=entry.digest, host=host, max_rank=entry.max_rank)

    def _read_into_segment(self, msg: ReadAdapter, signature: tuple) -> HostEntry:
        """In a thread: read, validate, serialise, write one segment."""
        read_adapter = self.confined_reader(msg)
        from mstar_actors.lora.host_copy import adapter_to_bytes
        from mstar_actors.models.loader import stored_weight

        if self.info.lora_base is None:
            from mstar_actors.lora import AdapterError

            raise AdapterError(f"adapter {msg.name!r}: this base model takes no adapters ({self.info.lora_refusal})")
        weights = read_adapter(msg.path, base=self.info.lora_base, max_rank=self.config.lora.max_lora_rank,
                               name=msg.name, base_weights=functools.partial(stored_weight, self.info.model_dir))
        weights = weights.to_dtype(self.host_dtype)
        known = self.tier.find(msg.name, weights.digest)
        if known is not None:  # the same weights again: share the copy
            return known
        blob = adapter_to_bytes(weights)
        name = shm.segment_name(self.run_id, f"adapter{next(self._counter)}")
        segment = shm.create_segment(name, max(len(blob), 1))
        try:
            segment.buf[: len(blob)] = blob
        finally:
            segment.close()
        return HostEntry(msg.name, msg.path, signature, weights.digest, name, len(blob), weights.max_rank)

    def unlink(self, evicted: list[HostEntry]) -> None:
        for entry in evicted:
            shm.unlink_segment(entry.segment)
            self.log.info("host copy of adapter %r (%s) evicted", entry.name, entry.digest[:12])

    def confined_reader(self, msg: ReadAdapter) -> Any:
        """``read_adapter`` for ``msg``: a runtime load's opens only files inside
        ``lora.adapter_dirs``; a configured adapter's are read where their links lead."""
        import os

        from mstar_actors.lora import read_adapter

        if not msg.confined:
            return read_adapter
        allowed = [os.path.realpath(d) for d in self.config.lora.adapter_dirs]
        return functools.partial(read_adapter, allowed_dirs=allowed)


def _reason(err: Exception) -> str:
    from mstar_actors.lora import AdapterError

    return str(err) if isinstance(err, AdapterError) else f"{type(err).__name__}: {err}"


def _code(err: Exception) -> str:
    """``AdapterReadFailed.code``: outside the allowed folders, the files no
    adapter (missing, invalid), or this machine failing the read (no room in
    shared memory, an I/O error: it may pass)."""
    from mstar_actors.lora.adapter_file import AdapterFileOutside

    if isinstance(err, AdapterFileOutside):
        return "adapter_path_not_allowed"
    unreadable_files = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
    if isinstance(err, (MemoryError, OSError)) and not isinstance(err, unreadable_files):
        return "adapter_read_error"
    return "invalid_adapter"
