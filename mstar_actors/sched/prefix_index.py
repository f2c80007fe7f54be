"""Prefix caching over full KV blocks, keyed by a hash chain.

Block ``i`` of a sequence is named by ``hash_i = H(hash_{i-1}, tokens of block
i)``; the chain starts from ``root_hash(root)``, where the root names the
weights that produced the KV (the served model, or an adapter's digest). So a
hash names the whole prefix up to and including its block under those weights:
two requests share a block only when every earlier token and the weights agree.

``H`` is BLAKE2b-256 over the parent hash and the msgpack encoding of the token
ids: stable across processes and runs, and collision-resistant (Python's
``hash()`` is neither).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import msgspec

HASH_SIZE = 32
_encode = msgspec.msgpack.Encoder().encode


def root_hash(root: str) -> bytes:
    """The chain's start for KV computed by the weights named ``root``."""
    return hashlib.blake2b(b"mstar-kv-root\0" + root.encode(), digest_size=HASH_SIZE).digest()


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block whose prefix (everything before it) is ``parent``."""
    digest = hashlib.blake2b(parent, digest_size=HASH_SIZE)
    digest.update(_encode(list(token_ids)))
    return digest.digest()


def media_hash(parent: bytes, media_digest: str) -> bytes:
    """``parent`` with a request's media digest mixed in: the parent of its
    first block that holds a media token, so blocks from there on are shared
    only by requests with the same media in the same places, and the text
    before it under its root alone (vLLM keys a block by the media it holds)."""
    return hashlib.blake2b(parent + media_digest.encode(), digest_size=HASH_SIZE, person=b"mstar-media").digest()


class PrefixIndex:
    """Hash of a computed full block -> the KV block that holds it.

    Entries are added only for blocks whose KV has been computed, and removed
    when the allocator evicts the block for reuse (see ``BlockAllocator``). One
    hash maps to at most one block: a second block computed with the same
    content (two identical prompts admitted together) is simply not indexed.
    """

    def __init__(self) -> None:
        self._block_ids: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._block_ids)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._block_ids

    def get(self, block_hash: bytes) -> int | None:
        return self._block_ids.get(block_hash)

    def insert(self, block_hash: bytes, block_id: int) -> bool:
        """Index ``block_id``; False (and no change) when the hash is already indexed."""
        if block_hash in self._block_ids:
            return False
        self._block_ids[block_hash] = block_id
        return True

    def remove(self, block_hash: bytes) -> None:
        del self._block_ids[block_hash]

    def lookup(self, block_hashes: Iterable[bytes]) -> list[int]:
        """Block ids of the longest indexed prefix of ``block_hashes``."""
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._block_ids.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids
