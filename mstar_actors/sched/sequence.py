"""Per-request bookkeeping of the scheduler."""

from __future__ import annotations

import enum

from mstar_actors.messages import Prepared, SamplingParams
from mstar_actors.sched.prefix_index import chain_hash, media_hash, root_hash


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One choice of a request: its tokens, how many have KV computed, and its block table.

    ``num_computed`` counts the leading tokens of ``prompt + output`` whose KV
    is in ``block_ids``; the last sampled token never has KV yet, so a running
    sequence has ``num_computed < num_tokens``. ``is_started`` is true while
    the workers hold state for it (from its ``SeqStart`` until its id is sent
    in ``StepPlan.finished``). ``state_slot`` is its recurrent-state slot while
    it runs, else -1 (always -1 for a model without recurrent state).

    With steps planned ahead (``Scheduler(max_in_flight=2)`` or 3), the chunks of
    steps in flight count in ``num_in_flight`` (their tokens) and
    ``num_samples_in_flight`` (the tokens they will sample): the next plan
    continues from ``num_scheduled`` and ``num_tokens_ahead``. ``epoch``
    changes whenever the sequence lets go of its KV (an end, a preemption):
    a row planned in an older epoch is void when its step's result arrives.
    """

    def __init__(self, request_id: str, req: Prepared, sampling: SamplingParams, *, root: str, lora_slot: int,
                 max_tokens: int, arrival: int, block_size: int, fields_bytes: int = 0):
        self.request_id = request_id
        self.parent_id = req.request_id  # the request whose choice this is
        self.root = root
        self.lora_slot = lora_slot
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.returns_prompt_ids = req.return_prompt_ids  # its first delta carries them
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.block_size = block_size
        self.fields_bytes = fields_bytes  # its sampling fields and media, encoded: what its start carries beside ids
        self.output_token_ids: list[int] = []
        self.num_computed = 0
        self.block_ids: list[int] = []
        self.state_slot = -1
        self.status = SeqStatus.WAITING
        self.is_started = False
        self.num_in_flight = 0  # tokens of this sequence's chunks in steps in flight
        self.num_samples_in_flight = 0  # tokens those steps will sample for it
        self.epoch = 0  # bumped when it lets go of its KV: rows planned before are void
        self.num_cached_tokens: int | None = None  # prefix hit at first admission
        self.num_preemptions = 0  # times its KV was taken back, to be recomputed
        self.num_queried_tokens = 0  # tokens looked up in the prefix cache then (0: the cache was not read)
        self._block_hashes: list[bytes] = []  # chain hashes of full blocks, computed lazily
        self._root_hash = root_hash(root)
        # block -> the digests of the media items whose first token is in it: the chain takes each there
        # (``media_hash``), so the blocks before an item are keyed by the items before it alone
        self._media_at: dict[int, list[str]] = {}
        for item, digest in zip(req.media, req.media_digests):
            self._media_at.setdefault(item.token_offset // block_size, []).append(digest)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled(self) -> int:
        """Tokens whose KV is computed or being computed by a step in flight."""
        return self.num_computed + self.num_in_flight

    @property
    def num_tokens_ahead(self) -> int:
        """Tokens known or being sampled by a step in flight."""
        return self.num_tokens + self.num_samples_in_flight

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    def block_token_ids(self, index: int) -> list[int]:
        """Tokens of block ``index`` of ``prompt + output`` (may straddle the two)."""
        start, end = index * self.block_size, (index + 1) * self.block_size
        num_prompt = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:end]
        tail = self.output_token_ids[max(start - num_prompt, 0) : max(end - num_prompt, 0)]
        return head + tail

    def block_hash(self, index: int) -> bytes:
        """Chain hash of full block ``index``. Tokens are append-only, so it never changes."""
        if index >= self.num_full_blocks:
            raise IndexError(f"request {self.request_id}: block {index} is not full")
        while len(self._block_hashes) <= index:
            i = len(self._block_hashes)
            parent = self._block_hashes[-1] if self._block_hashes else self._root_hash
            for digest in self._media_at.get(i, ()):
                parent = media_hash(parent, digest)
            self._block_hashes.append(chain_hash(parent, self.block_token_ids(i)))
        return self._block_hashes[index]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, blocks={self.block_ids})"
        )
