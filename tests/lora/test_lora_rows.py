"""Per-row LoRA slots (decode steps): the fused Triton kernel, run in Triton's
interpreter on CPU tensors, equals the torch rows reference and the segment
path on the same rows; a tiny model's decode step through ``begin_rows_step``
gives the same logits as through ``begin_step``; the SGMV kernels run in the
interpreter too."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from lora_factories import make_adapter, make_base

from mstar_actors.lora import LoraModule, LoraStack, build_segments
from mstar_actors.lora.ops import delta_rows_ref
from mstar_actors.models import lora_layers

triton_ops = pytest.importorskip("mstar_actors.lora.triton_ops")

# CPU tensors run the kernels only in Triton's interpreter, which conftest
# turns on where there is no CUDA device; on a GPU host the ``gpu`` tests of
# test_lora_triton_gpu.py run them compiled instead.
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="kernels on CPU tensors need Triton's interpreter (no CUDA)")

RANKS = {1: 4, 2: 8, 3: 16}  # slot -> rank, zero-padded to the stack's max rank


def make_stack(gen, in_features, output_sizes, *, dtype=torch.float32, is_embedding=False) -> LoraStack:
    """Slots 1-3 hold random factors of ranks 4, 8 and 16 on every shard."""
    stack = LoraStack(in_features, output_sizes, num_slots=4, max_rank=16, dtype=dtype, is_embedding=is_embedding)
    for slot, rank in RANKS.items():
        modules = []
        for shard, out in enumerate(output_sizes):
            a = torch.randn(rank, in_features, generator=gen) / (1.0 if is_embedding else in_features**0.5)
            b = torch.randn(out, rank, generator=gen) / rank**0.5
            scale = 0.5 + torch.rand((), generator=gen).item()
            modules.append((shard, LoraModule(a=a.to(dtype), b=b.to(dtype), scale=scale)))
        stack.install_slot(slot, modules)
    return stack


def random_slots(rng: random.Random, num_rows: int) -> list[int]:
    """Slot-0 rows interleaved with all three adapters (every slot present from 5 rows on)."""
    slots = [[0, 2, 1, 3, 0][i] if num_rows >= 5 else rng.randrange(1, 4) for i in range(min(num_rows, 5))]
    return slots + [rng.randrange(4) for _ in range(num_rows - len(slots))]


def int32(slots: list[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int32)


def on_kernels(stack: LoraStack) -> LoraStack:
    """The same stack (its tensors shared) run by the Triton kernels, which
    CPU tensors take in the interpreter; ``stack`` itself runs the reference."""
    kernel_stack = copy.copy(stack)
    kernel_stack.kernels = triton_ops
    return kernel_stack


def use_kernels(lora, monkeypatch) -> None:
    """Run a CPU model's LoRA by the Triton kernels, as ``enable_lora`` picks them on CUDA."""
    monkeypatch.setattr(lora, "kernels", triton_ops)
    for stack in lora.stacks.values():
        monkeypatch.setattr(stack, "kernels", triton_ops)


# ---------------------------------------------------------------- swaps


@interpreted
def test_piece_copies_move_every_piece_of_any_dtype_and_size_in_one_launch():
    """A swap's copies: pieces of bf16 factors (some past a chunk) and fp32
    scales, each into its own destination; nothing beside them is written."""
    gen = torch.Generator().manual_seed(0)
    sizes = [(3, 5), (triton_ops.COPY_CHUNK + 7,), (1,), (2 * triton_ops.COPY_CHUNK,)]
    src = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in sizes] + [torch.randn(3, generator=gen)]
    arena = torch.full((sum(t.numel() * t.element_size() for t in src) + 64,), 7, dtype=torch.uint8)
    dst, at = [], 2  # views of one buffer, at 2-byte offsets (not 16-byte aligned)
    for t in src:
        n = t.numel() * t.element_size()
        dst.append(arena[at : at + n].view(t.dtype).view(t.shape))
        at += n
    copies = triton_ops.piece_copies(dst, src)
    copies()
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    assert (arena[:2] == 7).all() and (arena[at:] == 7).all()
    with pytest.raises(ValueError, match="dense pieces of equal bytes"):
        triton_ops.piece_copies([dst[0]], [src[1]])
    with pytest.raises(ValueError, match="odd count"):
        triton_ops.piece_copies([torch.zeros(3, dtype=torch.uint8)], [torch.ones(3, dtype=torch.uint8)])


# ---------------------------------------------------------------- linears and embedding


@interpreted
@pytest.mark.parametrize("output_sizes", [(64,), (96, 40), (64, 32, 48)])
@pytest.mark.parametrize("num_rows", [1, 5])
def test_rows_kernel_equals_reference_and_segment_path(output_sizes, num_rows):
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    in_features = 72 if len(output_sizes) == 2 else 128
    stack = make_stack(gen, in_features, output_sizes)
    slots = random_slots(rng, num_rows)
    x = torch.randn(num_rows, in_features, generator=gen)
    y0 = torch.randn(num_rows, sum(output_sizes), generator=gen)
    want = stack.add_delta(y0.clone(), x, build_segments(slots))
    ref = stack.add_delta_rows(y0.clone(), x, int32(slots))  # CPU: the torch rows reference
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    for tiles in (None, 1, 2):  # one column tile per program, and a loop over two
        got = triton_ops.bgmv_rows(stack, y0.clone(), x, int32(slots), tiles=tiles)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        base_rows = [t for t, s in enumerate(slots) if s == 0]
        assert torch.equal(got[base_rows], y0[base_rows])


@interpreted
@pytest.mark.parametrize("output_sizes", [(64,), (64, 32, 48)])
@pytest.mark.parametrize("num_rows", [1, 16, 37])
def test_shrink_expand_kernels_equal_segment_path(output_sizes, num_rows):
    """Two launches over row tiles of one slot, K split or not, one or two
    column blocks a program; base rows and an untargeted shard unchanged."""
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    stack = make_stack(gen, 72, output_sizes)
    untargeted = len(output_sizes) - 1  # slot 2 leaves the last shard alone
    lo, hi = stack.offsets[untargeted], stack.offsets[untargeted + 1]
    stack.a[untargeted, 2] = 0
    stack.b[2, lo:hi] = 0
    stack.scales[untargeted, 2] = 0.0
    slots = random_slots(rng, num_rows)
    x = torch.randn(num_rows, 72, generator=gen)
    y0 = torch.randn(num_rows, sum(output_sizes), generator=gen)
    want = stack.add_delta(y0.clone(), x, build_segments(slots))
    groups = triton_ops.group_rows(int32(slots), stack.num_slots)
    # (BLOCK_M, BLOCK_K, SPLIT_K, BLOCK_N, TILES): the default, K in 3 splits
    # of 32 (the last one short), 64-row tiles with two 16-column blocks.
    for blocks in (None, (16, 32, 3, 32, 1), (64, 16, 1, 16, 2)):
        got = triton_ops.shrink_expand_rows(stack, y0.clone(), x, groups, blocks=blocks)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        base_rows = [t for t, s in enumerate(slots) if s == 0]
        assert torch.equal(got[base_rows], y0[base_rows])
        on_two = [t for t, s in enumerate(slots) if s == 2]
        assert torch.equal(got[on_two, lo:hi], y0[on_two, lo:hi])



@interpreted
def test_shrink_expand_with_one_adapter_slot_and_narrow_shapes():
    """max_loras 1 (one adapter slot), rank 4, K and outputs under tl.dot's 16: padded, not refused."""
    gen = torch.Generator().manual_seed(2)
    stack = LoraStack(8, (8, 12), num_slots=2, max_rank=4)
    stack.install_slot(1, [(i, LoraModule(a=torch.randn(4, 8, generator=gen), b=torch.randn(n, 4, generator=gen), scale=1.5))
                           for i, n in enumerate((8, 12))])
    slots = [1, 0, 1, 1, 0] * 4
    x, y0 = torch.randn(20, 8, generator=gen), torch.randn(20, 20, generator=gen)
    want = stack.add_delta(y0.clone(), x, build_segments(slots))
    got = triton_ops.shrink_expand_rows(stack, y0.clone(), x, triton_ops.group_rows(int32(slots), 2))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("num_slots", [2, 5, 33])
@pytest.mark.parametrize("block_m", [16, 64])
def test_row_tiles_never_exceed_their_bound(num_slots, block_m):
    """The grids' bound on row tiles holds for every way of spreading rows over slots."""
    rng = random.Random(num_slots * block_m)
    for num_rows in [1, 2, 15, 16, 17, 31, 100, 300]:
        for _ in range(50):
            slots = [rng.choice([0, *range(1, num_slots)[: rng.randrange(1, num_slots)]]) for _ in range(num_rows)]
            needed = sum(-(-slots.count(s) // block_m) for s in range(1, num_slots))
            assert needed <= triton_ops.num_row_tiles(num_rows, num_slots, block_m)


@pytest.mark.parametrize("shape", [(2048, 3), (2048, 1), (2048, 2), (8192, 1), (72, 3)])
def test_split_blocks_cover_k_and_fill_the_device_without_crowding_it(shape):
    k, num_shards = shape
    for num_rows in [1, 8, 16, 32, 64, 128, 256, 2048]:
        block_m, block_k, split_k, block_n, tiles = triton_ops._split_blocks(num_rows, num_shards, k, 2048, 132)
        assert block_m >= 16 and block_n >= 16 and tiles >= 1 and block_k <= triton_ops.triton.next_power_of_2(k)
        assert split_k == 1 or block_k * split_k <= k  # each split keeps a K tile of its own
        num_programs = -(-num_rows // block_m) * num_shards * split_k
        assert split_k == 1 or num_programs <= 132


def test_kernel_for_routes_by_row_count(monkeypatch):
    gemm, split = triton_ops.MIN_GEMM_ROWS, triton_ops.MIN_SPLIT_ROWS
    assert [triton_ops.kernel_for(n) for n in (1, gemm - 1, gemm, split - 1, split, 2048)] == [
        "bgmv", "bgmv", "gemm", "gemm", "split", "split"]
    fused = triton_ops.MIN_SPLIT_FUSED_ROWS  # a fused stack's own threshold
    assert triton_ops.uses_fused_rows(fused - 1) and not triton_ops.uses_fused_rows(fused)
    monkeypatch.setattr(triton_ops, "MIN_SPLIT_ROWS", 16)
    assert [triton_ops.kernel_for(n) for n in (1, 15, 16, 127, 2048)] == ["bgmv", "bgmv", "split", "split", "split"]
    assert triton_ops.needs_row_groups(16) and not triton_ops.needs_row_groups(15)
    monkeypatch.setattr(triton_ops, "MIN_SPLIT_ROWS", 64)
    assert [triton_ops.kernel_for(n) for n in (15, 16, 63, 64)] == ["bgmv", "gemm", "gemm", "split"]
    assert not triton_ops.needs_row_groups(63)  # the GEMM's shrink takes no groups


@interpreted
def test_add_delta_rows_takes_the_split_kernel_from_its_threshold(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    stack = make_stack(gen, 64, (64, 32))
    slots = [1, 0, 3, 2] * 4
    x, y0 = torch.randn(16, 64, generator=gen), torch.randn(16, 96, generator=gen)
    want = stack.add_delta(y0.clone(), x, build_segments(slots))
    monkeypatch.setattr(triton_ops, "MIN_SPLIT_ROWS", 16)
    calls = []
    split = triton_ops.shrink_expand_rows
    monkeypatch.setattr(triton_ops, "shrink_expand_rows", lambda *args, **kw: calls.append(1) or split(*args, **kw))
    got = on_kernels(stack).add_delta_rows(y0.clone(), x, int32(slots))
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

def test_group_rows_orders_rows_by_slot_stably():
    order, counts, starts = triton_ops.group_rows(int32([2, 0, 1, 2, 0, 3]), 5)
    assert counts.tolist() == [2, 1, 2, 1, 0] and starts.tolist() == [0, 2, 3, 5, 6]
    assert order.tolist() == [1, 4, 2, 0, 3, 5]
    assert order.dtype == counts.dtype == starts.dtype == torch.int32


@interpreted
def test_rows_kernel_in_bfloat16():
    gen = torch.Generator().manual_seed(7)
    stack = make_stack(gen, 64, (64, 32), dtype=torch.bfloat16)
    slots = [3, 0, 1, 2, 1]
    x = torch.randn(5, 64, generator=gen).bfloat16()
    y0 = torch.randn(5, 96, generator=gen).bfloat16()
    got = on_kernels(stack).add_delta_rows(y0.clone(), x, int32(slots))
    want = delta_rows_ref(y0.float(), x.float(), stack.a.float(), stack.b.float(), stack.scales, int32(slots), stack.offsets)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(got[1], y0[1])


@interpreted
def test_rows_embedding_equals_segment_path():
    gen = torch.Generator().manual_seed(3)
    stack = make_stack(gen, 300, (64,), is_embedding=True)
    slots = [0, 2, 1, 3, 0]
    ids = torch.tensor([5, 299, 0, 17, 5])
    y0 = torch.randn(5, 64, generator=gen)
    want = stack.add_delta(y0.clone(), ids, build_segments(slots))
    torch.testing.assert_close(stack.add_delta_rows(y0.clone(), ids, int32(slots)), want, rtol=1e-5, atol=1e-5)
    got = on_kernels(stack).add_delta_rows(y0.clone(), ids, int32(slots))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_all_base_rows_leave_y_bit_identical():
    gen = torch.Generator().manual_seed(4)
    stack = make_stack(gen, 64, (64, 32))
    x, y0 = torch.randn(5, 64, generator=gen), torch.randn(5, 96, generator=gen)
    zeros = torch.zeros(5, dtype=torch.int32)
    assert torch.equal(on_kernels(stack).add_delta_rows(y0.clone(), x, zeros), y0)
    assert torch.equal(stack.add_delta_rows(y0.clone(), x, zeros), y0)


@interpreted
def test_rows_read_a_strided_slots_view():
    """Slots may be a view into a larger staging buffer (as a graph's static inputs are)."""
    gen = torch.Generator().manual_seed(5)
    stack = make_stack(gen, 64, (64,))
    staged = torch.tensor([[1, 9], [0, 9], [3, 9]], dtype=torch.int32)[:, 0]  # stride 2
    x, y0 = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    want = stack.add_delta(y0.clone(), x, build_segments([1, 0, 3]))
    torch.testing.assert_close(on_kernels(stack).add_delta_rows(y0.clone(), x, staged), want, rtol=1e-5, atol=1e-5)


def test_rows_refuse_wrong_slots_and_shapes():
    stack = LoraStack(16, [8], num_slots=2, max_rank=4)
    x, y = torch.randn(3, 16), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"row_slots is torch.int64 \(3,\) on cpu; accepted: int32 \[T\]"):
        stack.add_delta_rows(y, x, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x \(3, 16\), y \(3, 8\) for 2 row slots; accepted: x \[2, 16\], y \[2, 8\]"):
        stack.add_delta_rows(y, x, torch.zeros(2, dtype=torch.int32))


# ---------------------------------------------------------------- through a model


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """A tiny Llama runner, three adapters of ranks 4/8/16 targeting every linear,
    the LM head and the embedding, each on its slot."""
    from mstar_actors.lora import BaseShapes, read_adapter
    from runner_factories import make_runner

    tmp = tmp_path_factory.mktemp("rows")
    model, config = make_base("llama", vocab_size=300)
    model.save_pretrained(tmp / "base")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens"]
    runner = make_runner(tmp / "base", dtype="float32", device="cpu", block_size=4, num_blocks=64, seed=0, max_loras=3, max_lora_rank=16)
    import copy

    for slot, rank in RANKS.items():
        folder, _ = make_adapter(tmp, copy.deepcopy(model), seed=slot, name=f"r{rank}", r=rank, lora_alpha=rank, target_modules=targets)
        runner.install_adapter(slot, read_adapter(folder, base=BaseShapes.from_hf_config(config), max_rank=16, name=f"r{rank}"))
    return runner


@pytest.fixture(scope="module")
def fused_runner(tmp_path_factory):
    """``runner``'s model and adapters with every decoder linear's A fused
    under its weight (``fuse_linear``, what CUDA stacks get by default)."""
    from mstar_actors.lora import BaseShapes, read_adapter
    from runner_factories import make_runner
    from mstar_actors.models.decoder import LoraLinear
    from mstar_actors.models.lora_layers import fuse_linear

    tmp = tmp_path_factory.mktemp("fused")
    model, config = make_base("llama", vocab_size=300)
    model.save_pretrained(tmp / "base")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens"]
    runner = make_runner(tmp / "base", dtype="float32", device="cpu", block_size=4, num_blocks=64, seed=0, max_loras=3, max_lora_rank=16)
    linears = [m for m in runner.model.modules() if isinstance(m, LoraLinear) and m.lora is not None]
    # The tiny model's A rows (4 slots x 16 x shards) outweigh its 64-wide
    # weights, so the share rule would refuse them: lifted for the test.
    with pytest.MonkeyPatch.context() as patch:
        from mstar_actors.models import lora_layers

        patch.setattr(lora_layers, "MAX_FUSED_SHARE", 100.0)
        assert all(fuse_linear(m, m.lora.stack) for m in linears)
    import copy

    for slot, rank in RANKS.items():
        folder, _ = make_adapter(tmp, copy.deepcopy(model), seed=slot, name=f"r{rank}", r=rank, lora_alpha=rank, target_modules=targets)
        runner.install_adapter(slot, read_adapter(folder, base=BaseShapes.from_hf_config(config), max_rank=16, name=f"r{rank}"))
    return runner


def _decode_logits(runner, slots, *, rows: bool, kernel: bool, monkeypatch) -> torch.Tensor:
    """Prefill then one decode step of one sequence per slot; the decode's logits
    (the KV writes repeat the same values, so the step can be run again)."""
    from plan_driver import PlanDriver

    from mstar_actors import messages
    from mstar_actors.runner.model_runner import build_batch

    sampling = messages.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    d = PlanDriver(runner, block_size=4, num_new=4, sampling=sampling)
    rids = [f"s{i}" for i in range(len(slots))]
    starts = [d.start(rid, [3 + 7 * i + j for j in range(5 + i % 5)], slot=s) for i, (rid, s) in enumerate(zip(rids, slots))]
    d.step(starts, [d.chunk(rid) for rid in rids])
    batch = build_batch(d.decodes(*rids), runner.seqs, runner.block_size, runner.num_kv_blocks, runner.max_model_len)
    monkeypatch.setattr(runner.lora, "uses_rows", rows)
    if kernel:  # the rows path through the Triton kernels in the interpreter (bgmv or split by the batch size, as on CUDA)
        use_kernels(runner.lora, monkeypatch)
    calls = []
    monkeypatch.setattr(type(runner.lora), "begin_rows_step", _spy(type(runner.lora).begin_rows_step, calls))
    try:
        logits, _ = runner._run_model(batch, [runner.seqs[rid] for rid in batch.sample_ids])
    finally:
        runner.forget(rids)
        monkeypatch.undo()
    assert len(calls) == int(rows), "the decode step did not take the expected LoRA path"
    return logits


def _spy(method, calls):
    def spied(self, row_slots, *args, **kwargs):
        calls.append(row_slots.tolist())
        return method(self, row_slots, *args, **kwargs)

    return spied


@pytest.mark.parametrize(
    "kernel,num_rows,min_split_rows",
    [(False, 5, 64), pytest.param(True, 5, 64, marks=interpreted), pytest.param(True, 16, 64, marks=interpreted),
     pytest.param(True, 16, 16, marks=interpreted)],
)
def test_decode_through_rows_equals_segments(runner, kernel, num_rows, min_split_rows, monkeypatch):
    """One program per row below ``MIN_SPLIT_ROWS``; the shrink-then-expand
    kernel from it (lowered to 16 here: the interpreter is too slow for
    batches of the real threshold)."""
    from unittest import mock

    slots = [[0, 2, 1, 3, 0][i % 5] for i in range(num_rows)]
    want = _decode_logits(runner, slots, rows=False, kernel=False, monkeypatch=monkeypatch)
    base = _decode_logits(runner, [0] * len(slots), rows=False, kernel=False, monkeypatch=monkeypatch)
    assert not torch.allclose(want[[1, 2, 3]], base[[1, 2, 3]], atol=1e-3), "adapters must change the logits"
    with mock.patch.object(triton_ops, "MIN_SPLIT_ROWS", min_split_rows):
        got = _decode_logits(runner, slots, rows=True, kernel=kernel, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base_rows = [t for t, s in enumerate(slots) if s == 0]
    assert torch.equal(got[base_rows], base[base_rows])  # base rows bit-identical to the base-only step


def _prefill_logits(runner, slots, *, rows: bool, kernel: bool, monkeypatch) -> torch.Tensor:
    """One prefill step mixing whole prompts (sampled) and partial chunks (not
    sampled): the LM head's rows are a subset of the token rows."""
    from plan_driver import PlanDriver

    from mstar_actors import messages
    from mstar_actors.runner.model_runner import build_batch

    sampling = messages.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    d = PlanDriver(runner, block_size=4, num_new=4, sampling=sampling)
    rids = [f"p{i}" for i in range(len(slots))]
    runner.start([d.start(rid, [5 + 3 * i + j for j in range(6 + i)], slot=s) for i, (rid, s) in enumerate(zip(rids, slots))])
    chunks = [d.chunk(rid, None if i % 2 == 0 else 4) for i, rid in enumerate(rids)]
    batch = build_batch(chunks, runner.seqs, runner.block_size, runner.num_kv_blocks, runner.max_model_len)
    monkeypatch.setattr(runner.lora, "uses_rows", rows)
    if kernel:
        use_kernels(runner.lora, monkeypatch)
    try:
        logits, _ = runner._run_model(batch, [runner.seqs[rid] for rid in batch.sample_ids])
    finally:
        runner.forget(rids)
        monkeypatch.undo()
    return logits


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=interpreted)])
def test_fused_linears_decode_through_rows_equals_segments(fused_runner, kernel, monkeypatch):
    """Linears whose A sits under the weight: one GEMM gives the base rows and
    every slot's shrink, the expand adds each row's delta (the torch
    reference, or the kernel in the interpreter); the same logits as the
    segment path on the same weights, and the expand ran for every linear."""
    slots = [[0, 2, 1, 3, 0][i % 5] for i in range(5)]
    want = _decode_logits(fused_runner, slots, rows=False, kernel=False, monkeypatch=monkeypatch)
    expands = []
    expand = LoraStack.add_delta_expand
    monkeypatch.setattr(LoraStack, "add_delta_expand", lambda stack, y, t, s: expands.append(1) or expand(stack, y, t, s))
    got = _decode_logits(fused_runner, slots, rows=True, kernel=kernel, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(expands) == 4 * fused_runner.model.spec.num_layers


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=interpreted)])
@pytest.mark.parametrize("slots,width", [([1, 0, 1], 2), ([0, 2, 1, 0], 3), ([3, 1], 4)])
def test_fused_steps_read_the_a_of_their_slots_only(fused_runner, kernel, slots, width, monkeypatch):
    """A small step's fused GEMMs read the buffer's weight and the A of the adapter slots below its width (the
    narrowest of ``widths`` above its rows' slots), not every slot's: the same logits as the segment path."""
    from mstar_actors.models import decoder
    from mstar_actors.models.decoder import LoraLinear

    lora = fused_runner.lora
    assert lora.widths(len(slots)) == (2, 3, 4) and lora.widths(lora_layers.NARROW_MAX_ROWS + 1) == (4,)
    assert lora.width_for(slots, len(slots)) == width
    want = _decode_logits(fused_runner, slots, rows=False, kernel=False, monkeypatch=monkeypatch)
    rows, linear = [], decoder.linear
    monkeypatch.setattr(decoder, "linear", lambda x, w, b=None: rows.append(w.shape[0]) or linear(x, w, b))
    got = _decode_logits(fused_runner, slots, rows=True, kernel=kernel, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    fused = [m for m in fused_runner.model.modules() if isinstance(m, LoraLinear) and m.fused_weight is not None]
    assert sorted(rows) == sorted(m.out_features + (width - 1) * m.lora.stack.slot_rows for m in fused)


@interpreted
@pytest.mark.parametrize("num_rows", [9, 21, 40])
def test_expand_kernel_equals_rows_reference(num_rows, monkeypatch):
    """``expand_rows`` over a fused stack's GEMM output: each row's own
    slot's columns of ``t``, every shard, base rows and an untargeted shard
    left bit-identical; by rows below ``MIN_TILE_ROWS``, by tiles of rows
    from it (several slots in a tile, a partial last tile at 21 and 40)."""
    monkeypatch.setattr(triton_ops, "MIN_TILE_PROGRAMS_PER_SM", 0)  # tiles at any width (these are narrow)
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    stack = make_stack(gen, 72, (64, 32, 48))
    stack.a[2, 2], stack.b[2, 96:144], stack.scales[2, 2] = 0, 0, 0.0  # slot 2 leaves the last shard alone
    weight = torch.randn(144, 72, generator=gen)
    fused, _ = stack.fuse_under(weight, None)
    assert stack.fused and stack.a[:, 1].data_ptr() == fused[144:].data_ptr() and fused.shape[0] == 144 + 3 * stack.slot_rows
    slots = random_slots(rng, num_rows)
    x = torch.randn(num_rows, 72, generator=gen)
    out = x @ fused.T
    y0 = out[:, :144].clone()
    want = stack.add_delta(x @ weight.T, x, build_segments(slots))
    assert triton_ops.expand_variant_of(stack, num_rows, 4)[0] == ("tiles" if num_rows >= 16 else "rows")
    for tiles, block_n in ((None, None), (2, 32)):
        got = triton_ops.expand_rows(stack, y0.clone(), stack.fused_shrink(out), int32(slots), tiles=tiles, block_n=block_n)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        base_rows = [t for t, s in enumerate(slots) if s == 0]
        assert torch.equal(got[base_rows], y0[base_rows])
        on_two = [t for t, s in enumerate(slots) if s == 2]
        assert torch.equal(got[on_two, 96:144], y0[on_two, 96:144])
    ref = stack.add_delta_expand(y0.clone(), stack.fused_shrink(out), int32(slots))  # CPU: the torch reference
    torch.testing.assert_close(ref, want, rtol=1e-4, atol=1e-4)


@interpreted
def test_gemm_rows_equals_the_segment_path(monkeypatch):
    """An unfused stack from ``MIN_GEMM_ROWS`` rows: every slot's shrink in one GEMM, then the tiled
    expand; base rows bit-identical, the groups never made."""
    monkeypatch.setattr(triton_ops, "MIN_TILE_PROGRAMS_PER_SM", 0)
    gen = torch.Generator().manual_seed(5)
    stack = make_stack(gen, 64, (96,))
    slots = [[0, 2, 1, 3, 0][i % 5] for i in range(20)]
    x, y0 = torch.randn(20, 64, generator=gen), torch.randn(20, 96, generator=gen)
    want = stack.add_delta(y0.clone(), x, build_segments(slots))
    assert triton_ops.kernel_for(20) == "gemm" and on_kernels(stack).row_groups(int32(slots)) is None
    got = on_kernels(stack).add_delta_rows(y0.clone(), x, int32(slots))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[0::5], y0[0::5])


def test_gemm_rows_keeps_the_shrink_in_float32_as_bgmv_rows(monkeypatch):
    """In half precision a row's delta from ``MIN_GEMM_ROWS`` rows (one GEMM's
    shrink, the tiles' expand) is ``bgmv_rows``' below them to within a last
    bit here and there: both keep the shrink in float32 (the tiles' two half
    dots, its rounding and the rest, to 2^-16 of it). Rounded to the dtype
    first, hundreds of its values would move, and a token's logits with
    them, between a graph's padded bucket and the eager step of its rows.
    (Float16: the interpreter's bfloat16 dots are wrong; the GPU test has both.)"""
    monkeypatch.setattr(triton_ops, "MIN_TILE_PROGRAMS_PER_SM", 0)  # tiles at this size
    gen = torch.Generator().manual_seed(5)
    stack = make_stack(gen, 64, (96,), dtype=torch.float16)
    slots = int32([[0, 2, 1, 3, 0][i % 5] for i in range(16)])
    x, y0 = (4 * torch.randn(16, 64, generator=gen)).half(), torch.zeros(16, 96, dtype=torch.float16)
    assert triton_ops.kernel_for(16) == "gemm" and triton_ops.takes_tiles(stack, 16, triton_ops._num_sms(x.device))
    got = triton_ops.gemm_rows(stack, y0.clone(), x, slots)
    want = triton_ops.bgmv_rows(stack, y0.clone(), x, slots)
    assert (got != want).sum() <= 4 and (got.float() - want.float()).abs().max() < 1e-3
    t = torch.mm(x.float(), stack.a.reshape(-1, 64).float().T)
    rounded = triton_ops.expand_rows(stack, y0.clone(), t.half(), slots)
    assert (rounded != want).sum() > 100


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=interpreted)])
def test_prefill_through_rows_equals_segments(runner, kernel, monkeypatch):
    """Every CUDA step takes the rows path, prefill chunks too: a step whose
    sampled rows are a subset of its token rows (one of them on the base
    model, one partial chunk on an adapter) gives the segment path's logits."""
    slots = [1, 0, 2, 3, 2]  # chunk 1 and 3 are partial (not sampled)
    want = _prefill_logits(runner, slots, rows=False, kernel=False, monkeypatch=monkeypatch)
    got = _prefill_logits(runner, slots, rows=True, kernel=kernel, monkeypatch=monkeypatch)
    assert got.shape == want.shape == (3, runner.spec.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the timing tool's decode table


def test_check_tool_decode_dry_run_validates_and_writes_json(tmp_path):
    import json

    out = tmp_path / "decode.json"
    run = _run_check_tool("--decode", "--dry-run", "--dtype", "float32", "--linears", "o", "--output", str(out))
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["linear"], r["batch"], r["mix"]) for r in rows] == [("o", 1, "mixed4"), ("o", 8, "mixed4")]
    assert all(r["error"] is None and r["rel_error"] < 1e-4 and r["rows_us"] for r in rows)


@pytest.mark.parametrize("min_split_rows", [64, 16])
@pytest.mark.parametrize("outs,k,is_embedding", [([64, 32, 32], 64, False), ([512, 512], 64, False), ([96], 300, True)])
def test_warm_up_covers_every_variant_serving_can_pick(outs, k, is_embedding, min_split_rows, monkeypatch):
    """Each compiled variant ``rows_delta`` launches at 1..N rows is launched
    by ``warm_up``, so no compile happens mid-serving (recorded, not launched)."""
    monkeypatch.setattr(triton_ops, "MIN_SPLIT_ROWS", min_split_rows)
    monkeypatch.setattr(triton_ops, "_num_sms", lambda device: 4)
    stack = LoraStack(k, outs, num_slots=3, max_rank=8, dtype=torch.float32, is_embedding=is_embedding)
    picked = []

    def record(kind):
        def launch(stack, y, *rest, **kw):
            variant = triton_ops.variant_of(stack, y.shape[0], 4)
            assert variant[0] == kind
            picked.append(variant)
            return y
        return launch

    monkeypatch.setattr(triton_ops, "bgmv_rows", record("bgmv"))
    monkeypatch.setattr(triton_ops, "shrink_expand_rows", record("split"))
    monkeypatch.setattr(triton_ops, "group_rows", lambda slots, n: None)
    max_rows = 300
    for num_rows in range(1, max_rows + 1):
        triton_ops.rows_delta(stack, torch.zeros(num_rows, sum(outs)), torch.zeros(num_rows, k), torch.zeros(num_rows, dtype=torch.int32))
    serving = set(picked)
    assert {v[0] for v in serving} == ({"bgmv"} if is_embedding else {"bgmv", "split"})
    picked.clear()
    triton_ops.warm_up(stack, max_rows)
    assert set(picked) == serving
    assert len(picked) == len(serving)  # one launch per variant


def test_warm_up_covers_the_expand_of_a_fused_stack(monkeypatch):
    """A fused stack's expand variants (rows below ``MIN_SPLIT_FUSED_ROWS``) are
    compiled by ``warm_up`` too, one launch each."""
    monkeypatch.setattr(triton_ops, "_num_sms", lambda device: 4)
    stack = LoraStack(64, [64, 32, 32], num_slots=3, max_rank=8, dtype=torch.float32)
    stack.fuse_under(torch.zeros(128, 64), None)
    monkeypatch.setattr(triton_ops, "bgmv_rows", lambda stack, y, *rest, **kw: y)
    monkeypatch.setattr(triton_ops, "shrink_expand_rows", lambda stack, y, *rest, **kw: y)
    monkeypatch.setattr(triton_ops, "group_rows", lambda slots, n: None)
    picked = []
    monkeypatch.setattr(triton_ops, "expand_rows", lambda stack, y, t, slots: picked.append(
        (y.shape[0], triton_ops.expand_variant_of(stack, y.shape[0], 4))) or y)
    max_rows = triton_ops.MIN_SPLIT_FUSED_ROWS + 40  # past the threshold: those rows take no expand
    triton_ops.warm_up(stack, max_rows)
    serving = {triton_ops.expand_variant_of(stack, n, 4) for n in range(1, triton_ops.MIN_SPLIT_FUSED_ROWS)}
    assert sorted(v for _, v in picked) == sorted(serving)
    assert all(n < triton_ops.MIN_SPLIT_FUSED_ROWS for n, _ in picked)


def _run_check_tool(*argv: str):
    """``python tools/check_lora_kernels.py ARGV`` from the repository root, as a user runs it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, str(root / "tools" / "check_lora_kernels.py"), *argv], cwd=root,
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=600)


@interpreted
def test_check_tool_rows_table_dry_run_checks_every_variant(tmp_path):
    """The device run's table, end to end on tiny linears in the interpreter."""
    import json

    out = tmp_path / "table.json"
    run = _run_check_tool("--rows-table", "--dry-run", "--linears", "o", "--rows", "16", "--mixes", "mixed4",
                          "--output", str(out))
    assert run.returncode == 0, run.stderr
    table = json.loads(out.read_text())["rows"]
    assert [(r["linear"], r["rows"], r["mix"]) for r in table] == [("o", 16, "mixed4")]
    assert set(table[0]["us"]) >= {"bgmv", "split", "sk*2"} and all(v is not None for r in table for v in r["us"].values())
    assert "sum        16 mixed4" in run.stdout and "group_rows once a step" in run.stdout
