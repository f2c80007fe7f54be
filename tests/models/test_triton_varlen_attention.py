"""Paged varlen attention: every query row of a step with prefill chunks in one
Triton launch, checked against the torch reference on the same cache and metadata.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET), so shapes stay tiny and float32; the ``gpu`` tests run it
compiled in bf16 at Llama-3.2-1B's shape and replay it from a CUDA graph.
"""

from __future__ import annotations

import math

import pytest
import torch

from mstar_actors.models.attention import (
    AttentionMetadata,
    TorchPagedAttention,
    max_varlen_items,
    plan_varlen_work,
)

triton_attention = pytest.importorskip("mstar_actors.models.triton_attention")
paged_varlen_attention = triton_attention.paged_varlen_attention
TritonPagedAttention = triton_attention.TritonPagedAttention

SENTINEL = 7.0  # what rows no work item covers must still hold


def make_step(query_lens: list[int], context_lens: list[int], *, num_heads: int = 4, num_kv_heads: int = 2,
              head_dim: int = 32, block_size: int = 16, num_pad_tokens: int = 0, max_blocks: int | None = None,
              num_blocks: int | None = None, dtype=torch.float32, device="cpu", seed: int = 0):
    """``(q, kv_cache, meta, scale)`` for one step: random q (``num_pad_tokens``
    extra rows past the last sequence's), a random cache, and tables of
    shuffled, distinct blocks padded with a real block of another sequence, so
    a kernel that reads past a context reads real data. The step's new K/V are
    taken to be in the cache already (``write_kv`` runs before ``attend``)."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in context_lens]
    max_blocks = max_blocks or max(1, max(need))
    num_blocks = num_blocks or sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, taken = [], 0
    for n in need:
        tables.append(order[taken : taken + n] + [order[-1]] * (max_blocks - n))
        taken += n
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens + num_pad_tokens, num_heads, head_dim, generator=gen)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    meta = AttentionMetadata.from_lists(slot_mapping=[0] * num_tokens, block_tables=tables, num_blocks=need,  # slots: not read by attend
                                        query_lens=query_lens, context_lens=context_lens, device=device)
    return q.to(device=device, dtype=dtype), kv.to(device=device, dtype=dtype), meta, head_dim**-0.5


def reference(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The torch backend in fp32 on the step's own rows."""
    num_tokens = sum(meta.query_lens_list)
    meta = AttentionMetadata(**{**meta.__dict__, "derived": {}, "varlen_work": None})
    return TorchPagedAttention().attend(q[:num_tokens].float(), kv_cache.float(), meta, scale)


def run_kernel(q, kv_cache, meta, scale, work: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """The kernel into an output pre-filled with ``SENTINEL``."""
    work = plan_varlen_work(meta.query_lens_list) if work is None else work
    work_t = torch.tensor(work, dtype=torch.int32, device=q.device).view(-1, 2)
    out = torch.full_like(q, SENTINEL)
    result = paged_varlen_attention(q, kv_cache, meta.block_tables, meta.query_start, meta.context_lens, work_t,
                                    scale, out=out)
    assert result is out
    return out


# Decode rows beside chunks with and without a cached prefix; chunks longer
# than VARLEN_BLOCK_M; contexts that are multiples of neither the block size
# nor the 64-token KV tile; a chunk whose rows straddle a KV tile boundary.
MIX = dict(query_lens=[1, 5, 1, 37, 20, 70], context_lens=[9, 5, 70, 50, 150, 100])


@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (6, 2), (8, 2)], ids=["G1", "G3", "G4"])
def test_kernel_matches_reference_across_groups(num_heads, num_kv_heads):
    q, kv, meta, scale = make_step(**MIX, num_heads=num_heads, num_kv_heads=num_kv_heads)
    out = run_kernel(q, kv, meta, scale)
    torch.testing.assert_close(out, reference(q, kv, meta, scale), atol=1e-5, rtol=1e-5)


def test_kernel_other_block_size_and_head_dim():
    """Pages of 12 tokens (not a power of two) and head_dim 16."""
    q, kv, meta, scale = make_step([3, 1, 18], [3, 40, 29], block_size=12, head_dim=16, num_heads=3,
                                   num_kv_heads=1, seed=1)
    torch.testing.assert_close(run_kernel(q, kv, meta, scale), reference(q, kv, meta, scale), atol=1e-5, rtol=1e-5)


def test_padded_items_sequences_and_tokens():
    """A graph-shaped step: work padded to ``max_varlen_items``, a padded
    sequence with no queries, token rows past the last sequence's. Rows no
    item covers are left as they were."""
    query_lens, context_lens = [17, 1, 0, 4], [40, 33, 1, 4]
    q, kv, meta, scale = make_step(query_lens, context_lens, num_heads=6, num_kv_heads=2, num_pad_tokens=5, seed=2)
    num_tokens = sum(query_lens)
    work = plan_varlen_work(query_lens, num_items=max_varlen_items(num_tokens + 5, len(query_lens)))
    assert work[-1] == (-1, 0)
    out = run_kernel(q, kv, meta, scale, work)
    torch.testing.assert_close(out[:num_tokens], reference(q, kv, meta, scale), atol=1e-5, rtol=1e-5)
    assert (out[num_tokens:] == SENTINEL).all()
    # The same step with the plain, unpadded list gives the same bits.
    torch.testing.assert_close(run_kernel(q, kv, meta, scale), out, atol=0, rtol=0)


def test_work_items_in_any_order_and_split_anywhere():
    """Items are independent: reversed, and one covering fewer than
    VARLEN_BLOCK_M rows with the next taking the rest, still cover each row once."""
    q, kv, meta, scale = make_step([20, 1], [30, 7], seed=3)
    work = [(1, 0), (0, 16), (0, 0)]  # reversed order
    expected = reference(q, kv, meta, scale)
    torch.testing.assert_close(run_kernel(q, kv, meta, scale, work), expected, atol=1e-5, rtol=1e-5)
    partial = run_kernel(q, kv, meta, scale, [(0, 4)])  # rows 4 .. 19 only
    torch.testing.assert_close(partial[4:20], expected[4:20], atol=1e-5, rtol=1e-5)
    assert (partial[:4] == SENTINEL).all() and (partial[20:] == SENTINEL).all()


def test_empty_work_writes_nothing():
    q, kv, meta, scale = make_step([2], [2])
    out = run_kernel(q, kv, meta, scale, work=[])
    assert (out == SENTINEL).all()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(work=torch.zeros(2, 2, dtype=torch.int64)), r"work \(torch.int64\) must be int32"),
        (dict(work=torch.zeros(2, 3, dtype=torch.int32)), r"work \(2, 3\) must be a contiguous \[P, 2\]"),
        (dict(query_start=torch.zeros(5, dtype=torch.int32)), r"query_start \(5,\) \[S \+ 1\]"),
        (dict(q=torch.zeros(3, 4, 24)), "head_dim must match"),
    ],
)
def test_refuses_bad_inputs(change, message):
    q, kv, meta, scale = make_step([2, 1], [2, 5])
    args = dict(q=q, kv_cache=kv, block_tables=meta.block_tables, query_start=meta.query_start,
                context_lens=meta.context_lens, work=torch.zeros(1, 2, dtype=torch.int32), scale=scale)
    with pytest.raises(ValueError, match=message):
        paged_varlen_attention(**(args | change))


# --- the backend ----------------------------------------------------------------------------


def test_backend_varlen_work_ignores_stale_lists():
    """With ``varlen_work`` (a graphed mixed step) only the tensors are read."""
    q, kv, meta, scale = make_step(**MIX, num_heads=6, num_kv_heads=2, num_pad_tokens=3, seed=4)
    expected = reference(q, kv, meta, scale)
    num_items = max_varlen_items(q.shape[0], meta.num_seqs)
    meta.varlen_work = torch.tensor(plan_varlen_work(meta.query_lens_list, num_items), dtype=torch.int32)
    meta.query_lens_list, meta.context_lens_list, meta.num_blocks_list = [1] * 6, [1] * 6, [1] * 6
    meta.derived = {"decode": None, "triton_decode": None}
    out = TritonPagedAttention().attend(q, kv, meta, scale)
    torch.testing.assert_close(out[: expected.shape[0]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("eager_varlen", [True, False])
def test_backend_eager_mixed_step(eager_varlen):
    """Eager mixed steps: one varlen launch (work list built once per step), or
    the decode kernel plus SDPA per chunk; the same result either way."""
    q, kv, meta, scale = make_step(**MIX, seed=5)
    expected = reference(q, kv, meta, scale)
    backend = TritonPagedAttention(eager_varlen=eager_varlen)
    torch.testing.assert_close(backend.attend(q, kv, meta, scale), expected, atol=1e-5, rtol=1e-5)
    if eager_varlen:
        work = meta.derived["triton_varlen"]
        assert work.tolist() == [list(item) for item in plan_varlen_work(MIX["query_lens"])]
        torch.testing.assert_close(backend.attend(q, kv, meta, scale), expected, atol=1e-5, rtol=1e-5)
        assert meta.derived["triton_varlen"] is work  # the second layer reuses it


def test_backend_warm_up_compiles_varlen(monkeypatch):
    """``warm_up`` launches the varlen kernel too (here: in the interpreter)."""
    launched = []
    real = triton_attention.paged_varlen_attention
    monkeypatch.setattr(triton_attention, "paged_varlen_attention",
                        lambda *args, **kwargs: launched.append(args[0].shape) or real(*args, **kwargs))
    _, kv, _, _ = make_step([1], [1])
    TritonPagedAttention().warm_up(4, 32, kv)
    assert launched == [(1, 4, 32)]


# --- on the GPU -----------------------------------------------------------------------------


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected).norm() / expected.norm()).item()


LLAMA_1B = dict(num_heads=32, num_kv_heads=8, head_dim=64, block_size=16)
GPU_MIXES = {
    "prefill30+7dec": ([30] + [1] * 7, [30] + [100 + 13 * i for i in range(7)]),
    "4x256-prefix": ([256] * 4, [256, 700, 1030, 2000]),
    "512+31dec": ([512] + [1] * 31, [1500] + [150 + 50 * i for i in range(31)]),
    "2048": ([2048], [2048]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("mix", list(GPU_MIXES), ids=list(GPU_MIXES))
def test_kernel_bf16_on_cuda(mix):
    query_lens, context_lens = GPU_MIXES[mix]
    q, kv, meta, scale = make_step(query_lens, context_lens, **LLAMA_1B, dtype=torch.bfloat16, device="cuda",
                                   num_pad_tokens=8)
    out = run_kernel(q, kv, meta, scale)
    num_tokens = sum(query_lens)
    assert relative_error(out[:num_tokens], reference(q, kv, meta, scale)) < 1e-2
    assert (out[num_tokens:] == SENTINEL).all()


@pytest.mark.gpu
def test_kernel_fp32_on_cuda():
    q, kv, meta, scale = make_step(**MIX, num_heads=6, num_kv_heads=2, head_dim=128, device="cuda")
    torch.testing.assert_close(run_kernel(q, kv, meta, scale), reference(q, kv, meta, scale), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_backend_varlen_replays_in_a_cuda_graph():
    """Captured once on static tensors, replayed with another step's metadata
    (other chunk lengths, contexts and tables) copied into the same tensors."""
    num_tokens, num_seqs, width = 96, 6, 64
    shape = dict(**LLAMA_1B, dtype=torch.bfloat16, device="cuda", max_blocks=width, num_blocks=256)
    steps = [([40, 1, 1, 30, 1, 23], [40, 90, 300, 530, 17, 23]),
             ([1, 64, 1, 1, 0, 29], [1000, 64, 5, 77, 1, 129])]
    cases = [make_step(*step, **shape, num_pad_tokens=num_tokens - sum(step[0]), seed=i)
             for i, step in enumerate(steps)]
    num_items = max_varlen_items(num_tokens, num_seqs)
    q, kv, first, scale = cases[0]
    q, kv = q.clone(), kv.clone()
    meta = AttentionMetadata(**{key: value.clone() if isinstance(value, torch.Tensor) else value
                                for key, value in first.__dict__.items()})
    meta.varlen_work = torch.tensor(plan_varlen_work(meta.query_lens_list, num_items), dtype=torch.int32,
                                    device="cuda")
    backend = TritonPagedAttention()
    backend.attend(q, kv, meta, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(q, kv, meta, scale)
    for fresh_q, fresh_kv, fresh, _ in reversed(cases):
        q.copy_(fresh_q)
        kv.copy_(fresh_kv)
        for name in ("block_tables", "query_start", "context_lens"):
            getattr(meta, name).copy_(getattr(fresh, name))
        meta.varlen_work.copy_(torch.tensor(plan_varlen_work(fresh.query_lens_list, num_items), dtype=torch.int32))
        graph.replay()
        rows = sum(fresh.query_lens_list)
        assert relative_error(out[:rows], reference(q, kv, fresh, scale)) < 1e-2
