"""Transport: typed, bounded channels between actors.

``Channel`` is the interface; ``MemoryChannel`` implements it in one process
for tests; ``ShmRing`` between two processes over shared memory (the launcher
calls ``create_ring`` and hands each end a ``RingSpec`` for ``open_ring``);
``BroadcastChannel`` sends one stream to N rings; ``TensorArena`` carries
large tensors by reference (``TensorRef``). ``cleanup_run`` /
``cleanup_stale`` remove the shared memory of a finished or crashed run.
"""

from transport.broadcast import BroadcastChannel
from transport.channel import Channel, ChannelStats
from transport.codec import Codec
from transport.errors import ChannelBroken, ChannelClosed, ChannelError, ChannelFull, DecodeError, MessageTooLarge
from transport.memory import MemoryChannel
from transport.ring import RingSpec, ShmRing, create_ring, open_ring, unlink_ring
from transport.shm import cleanup_orphans, cleanup_run, cleanup_stale, register_run



def __getattr__(name: str):
    # The arena needs torch; import it only where it is used, so actors
    # without torch (the frontend) start fast.
    if name in ("TensorArena", "ArenaSpec", "ArenaFull", "create_arena", "unlink_arena"):
        from transport import arena

        return getattr(arena, name)
    raise AttributeError(f"module 'transport' has no attribute {name!r}")


__all__ = [
    "ArenaFull",
    "ArenaSpec",
    "TensorArena",
    "create_arena",
    "unlink_arena",
    "BroadcastChannel",
    "Channel",
    "ChannelBroken",
    "ChannelClosed",
    "ChannelError",
    "ChannelFull",
    "ChannelStats",
    "MessageTooLarge",
    "Codec",
    "DecodeError",
    "MemoryChannel",
    "RingSpec",
    "ShmRing",
    "cleanup_orphans",
    "cleanup_run",
    "cleanup_stale",
    "create_ring",
    "open_ring",
    "register_run",
    "unlink_ring",
]
