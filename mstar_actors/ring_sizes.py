"""How large each ring of a run is, and how much of one a step's plan may fill.

A plan carries each starting sequence's token ids and each row's block table;
a first delta with ``return_token_ids`` and a ``Prepared`` carry a prompt's ids.
So every ring but the launcher's holds one sequence of ``max_model_len`` tokens
(its ids and its table, at msgpack's widest id) beside its request's other
fields, and the scheduler fills a plan to at most ``plan_bytes``: sequences
past that wait for the next step (one that cannot fit even alone is refused)."""

from __future__ import annotations

ID_BYTES = 5  # a token or block id's encoded size at most (msgpack's uint32)
FIELDS_ROOM = 1 << 20  # a sequence's other fields (sampling: stops, a schema, logit biases)
PLAN_HEADROOM = 1 << 20  # a plan's orders beside its rows (ends, media, installs)
CONTROL_RING_BYTES = 1 << 18  # the launcher's rings: tracebacks travel here


def sequence_ids(num_tokens: int, block_size: int) -> int:
    """The ids a sequence of ``num_tokens`` carries: its tokens and its block table."""
    return num_tokens + -(-num_tokens // block_size)


def ring_bytes(name: str, config, max_model_len: int) -> int:
    """A ring's size: ``transport.ring_bytes``, or more where one sequence of
    ``max_model_len`` tokens needs it; the launcher's control rings less; a
    frontend's ring to prepare carries whole request bodies (their media as
    data: URLs), so it holds the largest ``server.max_body_bytes`` allows,
    its encoding's overhead and a few more in flight."""
    if "launcher" in name:
        return CONTROL_RING_BYTES
    one = ID_BYTES * sequence_ids(max_model_len, config.kv.block_size) + FIELDS_ROOM + PLAN_HEADROOM
    size = max(config.transport.ring_bytes, one)
    if name.endswith(".prepare") and name.startswith("frontend"):
        body = config.server.max_body_bytes
        return max(size, body + body // 4 + (1 << 20))
    return size


def plan_bytes(config, max_model_len: int) -> int:
    """What a step's plan fills of the conductor's ring to the ranks at most."""
    return ring_bytes("conductor.workers", config, max_model_len) - PLAN_HEADROOM
