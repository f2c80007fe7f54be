"""Child-process entry points for the transport tests (spawn context: they
must be importable by name and cheap to import)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sys

import msgspec

from transport import open_ring


class Blob(msgspec.Struct, tag=True, array_like=True):
    seq: int
    data: bytes


class Done(msgspec.Struct, tag=True, array_like=True):
    num_sent: int


Msg = Blob | Done


def payloads(seed: int, num: int, max_bytes: int):
    """The same seeded payloads on both sides of a test."""
    rng = random.Random(seed)
    for seq in range(num):
        yield Blob(seq, rng.randbytes(rng.randint(0, max_bytes)))


def write_seeded(spec, seed: int, num: int, max_bytes: int) -> None:
    async def main():
        ring = open_ring(spec, "writer", Msg)
        for blob in payloads(seed, num, max_bytes):
            await ring.send(blob)
        await ring.send(Done(num))
        ring.close()

    asyncio.run(main())


def write_then_hang(spec, num: int) -> None:
    """Send ``num`` messages, then wait to be killed."""

    async def main():
        ring = open_ring(spec, "writer", Msg)
        for seq in range(num):
            await ring.send(Blob(seq, b"x" * seq))
        await asyncio.Event().wait()

    asyncio.run(main())


def open_reader_then_hang(spec, ready) -> None:
    """Open the reader end, say so on the ``ready`` connection, wait to be killed."""

    async def main():
        open_ring(spec, "reader", Msg)
        ready.send("open")
        await asyncio.Event().wait()

    asyncio.run(main())


def open_reader_and_exit(spec) -> None:
    """Attach, read nothing, exit: the segment must outlive us."""
    open_ring(spec, "reader", Msg).close()


def read_and_digest(spec, expected_digest: str) -> None:
    """Read until Done; exit 0 when the digest of (seq, data) matches."""

    async def main():
        ring = open_ring(spec, "reader", Msg)
        digest = hashlib.sha256()
        async for msg in ring:
            if isinstance(msg, Done):
                break
            digest.update(msg.seq.to_bytes(8, "little") + msg.data)
        ring.close()
        return digest.hexdigest()

    got = asyncio.run(main())
    if got != expected_digest:
        print(f"digest mismatch on ring {spec.name}", file=sys.stderr)
        sys.exit(1)


def digest_of(seed: int, num: int, max_bytes: int) -> str:
    digest = hashlib.sha256()
    for blob in payloads(seed, num, max_bytes):
        digest.update(blob.seq.to_bytes(8, "little") + blob.data)
    return digest.hexdigest()


def create_ring_and_die(runs_root: str, run_id: str) -> None:
    """A launcher that creates its shared memory and dies without cleanup."""
    from transport import create_ring

    create_ring(os.path.join(runs_root, run_id), run_id, "steps", 4096)
    os._exit(0)


def view_and_release(spec, refs, expected_sums) -> None:
    """A consumer in another process: map each tensor, check it, release it."""
    from transport.arena import TensorArena

    arena = TensorArena(spec, "consumer")
    for ref, expected in zip(refs, expected_sums):
        tensor = arena.view(ref)
        if float(tensor.double().sum()) != expected or tuple(tensor.shape) != ref.shape:
            print(f"tensor at {ref.offset} differs", file=sys.stderr)
            sys.exit(1)
        del tensor
        arena.release(ref)
    arena.close()
