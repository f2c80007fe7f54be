"""The CPU decode rows' contiguous K/V copy (``DecodeStaging``): which row each
sequence takes (pure), and attention through it against the gather path over
steps whose batches change (joins, ends, prefill chunks, shared prefixes, a
layer that misses a step, another cache, a copy over budget)."""

from __future__ import annotations

import random

import torch

from mstar_actors.models.attention import (
    AttentionMetadata,
    DecodeStaging,
    StagedRow,
    TorchPagedAttention,
    match_staged_rows,
)

BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 64, 6, 2, 8


# -- match_staged_rows (pure) ---------------------------------------------------------


def test_a_sequence_one_step_later_keeps_its_row_and_a_new_one_takes_the_lowest_free():
    previous = [StagedRow((5, 6), 7), None, StagedRow((9,), 2)]
    rows, fills, contents = match_staged_rows(previous, [((9,), 3), ((1, 2), 6), ((5, 6), 8)])
    assert rows == [2, 1, 0]
    assert fills == [False, True, False]
    assert contents == [StagedRow((5, 6), 8), StagedRow((1, 2), 6), StagedRow((9,), 3)]


def test_crossing_into_a_new_block_still_continues_the_row():
    rows, fills, _ = match_staged_rows([StagedRow((3,), 4)], [((3, 8), 5)])
    assert (rows, fills) == ([0], [False])


def test_other_length_or_other_blocks_is_refilled_and_untaken_rows_are_dropped():
    previous = [StagedRow((3, 4), 6), StagedRow((7,), 2)]
    rows, fills, contents = match_staged_rows(previous, [((3, 5), 7), ((7,), 4)])
    assert fills == [True, True]
    assert rows == [0, 1]
    assert contents == [StagedRow((3, 5), 7), StagedRow((7,), 4)]
    assert match_staged_rows(previous, []) == ([], [], [])


def test_a_row_is_taken_once_when_two_sequences_share_its_blocks():
    """Two sequences on the same full prefix blocks: one continues, the other is filled."""
    rows, fills, _ = match_staged_rows([StagedRow((3,), 4)], [((3, 8), 5), ((3, 9), 5)])
    assert rows == [0, 1]
    assert fills == [False, True]


# -- attention through the copy against the gather path ----------------------------------


class NoStaging:
    def plan(self, *args):
        return None


class PagedWorld:
    """Sequences on a random paged cache of ``num_layers`` layers; each step
    writes its new tokens' K/V and returns the metadata and queries."""

    def __init__(self, seed: int, num_layers: int = 2):
        self.gen = torch.Generator().manual_seed(seed)
        self.caches = [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
                       for _ in range(num_layers)]
        self.free = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[str, dict] = {}

    def share(self, name: str, source: str, num_tokens: int) -> None:
        """``name`` starts on ``source``'s first full blocks (a prefix-cache hit)."""
        num_blocks = num_tokens // BLOCK_SIZE
        self.seqs[name] = dict(blocks=list(self.seqs[source]["blocks"][:num_blocks]), length=num_blocks * BLOCK_SIZE)

    def end(self, name: str) -> None:
        self.free.extend(self.seqs.pop(name)["blocks"])

    def step(self, entries: list[tuple[str, int]]) -> tuple[AttentionMetadata, torch.Tensor]:
        slots, tables, lens = [], [], []
        for name, num_new in entries:
            seq = self.seqs.setdefault(name, dict(blocks=[], length=0))
            for pos in range(seq["length"], seq["length"] + num_new):
                if pos // BLOCK_SIZE == len(seq["blocks"]):
                    seq["blocks"].append(self.free.pop())
                slots.append(seq["blocks"][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            seq["length"] += num_new
            tables.append(list(seq["blocks"]))
            lens.append(seq["length"])
        width = max(len(t) for t in tables)
        query_lens = [n for _, n in entries]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            query_start=torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32),
            context_lens=torch.tensor(lens, dtype=torch.int32),
            query_lens_list=query_lens, context_lens_list=lens, num_blocks_list=[len(t) for t in tables],
        )
        writer = TorchPagedAttention()
        for cache in self.caches:
            k, v = (torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=self.gen) for _ in range(2))
            writer.write_kv(cache, k, v, meta)
        return meta, torch.randn(len(slots), NUM_HEADS, HEAD_DIM, generator=self.gen)


def fresh(meta: AttentionMetadata) -> AttentionMetadata:
    """The same step for another backend (``derived`` is per backend and step)."""
    return AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.query_start, meta.context_lens,
                             meta.query_lens_list, meta.context_lens_list, meta.num_blocks_list)


def check_step(world: PagedWorld, staged: TorchPagedAttention, entries, layers=None) -> AttentionMetadata:
    meta, q = world.step(entries)
    reference = TorchPagedAttention()
    reference.staging = NoStaging()
    expected_meta = fresh(meta)
    for i in layers if layers is not None else range(len(world.caches)):
        cache = world.caches[i]
        out = staged.attend(q, cache, meta, 0.3)
        torch.testing.assert_close(out, reference.attend(q, cache, expected_meta, 0.3), atol=1e-5, rtol=1e-5)
    return meta


def test_decode_steps_through_joins_ends_chunks_and_shared_prefixes_match_the_gather_path():
    seed = 11
    print(f"seed {seed}")
    world, staged = PagedWorld(seed), TorchPagedAttention()
    check_step(world, staged, [("a", 9), ("b", 3)])  # prefill only: nothing staged
    assert staged.staging.plan(fresh(world.step([("c", 2)])[0]), torch.zeros(2, NUM_HEADS, HEAD_DIM),
                               world.caches[0]) is None
    check_step(world, staged, [("a", 1), ("b", 1), ("c", 1)])  # all new rows: filled
    meta = check_step(world, staged, [("a", 1), ("b", 1), ("c", 1)])  # continued rows, in order
    assert meta.derived["staged"].is_identity and not meta.derived["staged"].fills
    world.end("b")
    world.share("d", "a", 8)  # a prefix hit on a's first two full blocks
    check_step(world, staged, [("c", 1), ("d", 5), ("a", 1)])  # mixed: a prefill chunk among decodes
    meta = check_step(world, staged, [("c", 1), ("a", 1), ("d", 1), ("e", 1)])  # d and e join, b's row freed
    assert not meta.derived["staged"].is_identity
    for _ in range(6):  # past a block boundary and the copy's first length
        check_step(world, staged, [("c", 1), ("a", 1), ("d", 1), ("e", 1)])


def test_a_layer_that_missed_a_step_or_another_cache_is_refilled():
    world, staged = PagedWorld(3, num_layers=3), TorchPagedAttention()
    check_step(world, staged, [("a", 6), ("b", 2)])
    check_step(world, staged, [("a", 1), ("b", 1)])
    check_step(world, staged, [("a", 1), ("b", 1)], layers=[0])  # layers 1, 2 miss this step
    check_step(world, staged, [("a", 1), ("b", 1)])
    world.caches[2] = world.caches[2].clone()  # the same blocks in another tensor
    check_step(world, staged, [("a", 1), ("b", 1)])


def test_a_copy_over_budget_takes_the_gather_path():
    world, staged = PagedWorld(5), TorchPagedAttention()
    staged.staging = DecodeStaging(max_bytes_per_layer=2 * 2 * NUM_KV_HEADS * 20 * HEAD_DIM * 4)  # 2 rows of 20
    check_step(world, staged, [("a", 9), ("b", 3)])
    meta = check_step(world, staged, [("a", 1), ("b", 1)])
    assert meta.derived["staged"] is not None
    check_step(world, staged, [("a", 12), ("b", 1)])  # a at 22 keys, then 23: over
    meta = check_step(world, staged, [("a", 1), ("b", 1)])
    assert meta.derived["staged"] is None and not staged.staging.layers
