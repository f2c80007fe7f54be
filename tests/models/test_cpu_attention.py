"""Attention on our CPU kernel (``cpu_attention``) against the torch
reference it replaces, on the same paged cache: pure decode steps, prefill
chunks (with and without a cached prefix) beside decode rows, grouped
heads, a head size that is not a multiple of 8, blocks out of order; and
the kernel built for each instruction set this CPU has, on random paged
caches."""

from __future__ import annotations

import pytest
import torch

from mstar_actors.models import cpu_attention, cpu_linear
from mstar_actors.models.attention import AttentionMetadata, TorchPagedAttention

needs_kernel = pytest.mark.skipif(cpu_attention.kernel() is None, reason="no AVX-512 or AVX2, or no C compiler here")
BLOCK_SIZE = 4


def make_step(query_lens: list[int], context_lens: list[int], gen: torch.Generator) -> AttentionMetadata:
    """Sequences whose contexts lie in shuffled blocks of a 40-block cache (block 0 unused)."""
    order = (torch.randperm(39, generator=gen) + 1).tolist()
    tables, slots = [], []
    for q_len, ctx in zip(query_lens, context_lens):
        num = -(-ctx // BLOCK_SIZE)
        blocks, order = order[:num], order[num:]
        tables.append(blocks)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx - q_len, ctx)]
    width = max(map(len, tables))
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start=torch.tensor(starts, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32), query_lens_list=query_lens,
        context_lens_list=context_lens, num_blocks_list=[len(t) for t in tables])


@needs_kernel
@pytest.mark.parametrize("query_lens, context_lens", [
    ([1], [1]), ([1], [13]), ([1, 1, 1], [5, 17, 8]),  # pure decode
    ([1, 6, 1, 3], [9, 6, 22, 10]),  # decode rows between prefill chunks
    ([7], [7]), ([5, 2], [14, 9]),  # prefill chunks alone, whole prompts and after a cached prefix
])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 20)])
def test_matches_the_torch_reference(query_lens, context_lens, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(sum(context_lens) + head_dim)
    meta = make_step(query_lens, context_lens, gen)
    cache = torch.randn(2, 40, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    want = TorchPagedAttention().attend(q, cache, meta, 0.125)
    meta.derived.clear()
    got = cpu_attention.CpuPagedAttention().attend(q, cache, meta, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "cpu_rows" in meta.derived  # the kernel's path, not the fallback


def test_other_dtypes_and_graphed_steps_keep_the_reference():
    gen = torch.Generator().manual_seed(0)
    meta = make_step([1, 1], [5, 9], gen)
    cache = torch.randn(2, 40, BLOCK_SIZE, 2, 16, generator=gen, dtype=torch.float64)
    q = torch.randn(2, 2, 16, generator=gen, dtype=torch.float64)
    got = cpu_attention.CpuPagedAttention().attend(q, cache, meta, 0.25)
    assert "cpu_rows" not in meta.derived
    meta.derived.clear()
    torch.testing.assert_close(got, TorchPagedAttention().attend(q, cache, meta, 0.25))


def built_for(isa: str):
    """The kernel built for ``isa`` (the source is one; the flags differ), declared."""
    lib = cpu_linear.load_library(cpu_linear.build_library("cpu_attention", cpu_attention.KERNEL_SOURCE, isa))
    cpu_attention._declare(lib)
    return lib


ISAS = [pytest.param(isa, marks=pytest.mark.skipif(cpu_linear.kernel_isa((isa,)) is None or cpu_linear.find_compiler() is None,
                                                   reason=f"no {isa} or no C compiler here"))
        for isa in cpu_linear.ISA_FLAGS]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("context_lens, num_heads, num_kv_heads, head_dim, block_size", [
    ([1], 9, 3, 64, 16),  # a context of one key
    ([1, 16, 17, 33, 64, 100], 9, 3, 64, 16),  # lengths on and across block and 32-key tile boundaries
    ([70, 5, 31], 34, 2, 72, 8),  # 17 query heads per K/V head (more than a pass takes), a head of 64 + 8
    ([40, 3], 6, 6, 20, 4),  # no grouping, a head of 8 + 8 + 4
    ([300] * 8, 9, 3, 64, 16),  # enough work for the threads
])
def test_each_instruction_set_matches_sdpa_on_random_pages(isa, context_lens, num_heads, num_kv_heads, head_dim,
                                                           block_size, num_threads=2):
    seed = sum(context_lens) + num_heads + head_dim
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(widths) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(widths), dtype=torch.long)
    start = 0
    for b, width in enumerate(widths):
        tables[b, :width] = order[start : start + width]
        start += width
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
    lens = torch.tensor(context_lens)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = cpu_attention.decode_attention(built_for(isa), q, cache, tables, lens, head_dim**-0.5)
    finally:
        torch.set_num_threads(before)
    group = num_heads // num_kv_heads
    for b, n in enumerate(context_lens):
        k, v = (cache[i][tables[b, : widths[b]]].flatten(0, 1)[:n].transpose(0, 1) for i in (0, 1))  # [KH, n, D]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None], k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), scale=head_dim**-0.5)[:, 0]
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}, sequence {b}: {m}")
