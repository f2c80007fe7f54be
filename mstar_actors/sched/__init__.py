"""Scheduler core: block allocator, prefix index, continuous batching. Pure classes, no I/O."""

from mstar_actors.sched.block_allocator import BlockAllocator
from mstar_actors.sched.prefix_index import PrefixIndex, chain_hash, root_hash
from mstar_actors.sched.scheduler import PARKED, Scheduler
from mstar_actors.sched.sequence import Sequence, SeqStatus
from mstar_actors.sched.state_slots import StateSlotAllocator

__all__ = ["PARKED", "BlockAllocator", "PrefixIndex", "Scheduler", "SeqStatus", "Sequence", "StateSlotAllocator",
           "chain_hash", "root_hash"]
