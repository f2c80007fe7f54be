"""An adapter install through ``SlotStaging`` (one pinned staging copy, one
host-to-device copy, a stream of its own) writes exactly what the plain
per-stack ``install_slot`` writes. Most of it GPU only (pinned memory, a CUDA
stream); on CPU the kept images' reinstalls, their dense forms included."""

from __future__ import annotations

import pytest
import torch

from mstar_actors.lora.adapter_file import LoraModule
from mstar_actors.lora.ops import TORCH_ROWS, DenseFactors, LoraStack, SlotStaging


def _kernels(name: str):
    """What copies a device twin into a slot: ``_foreach_copy_`` ("torch") or one Triton launch."""
    return TORCH_ROWS if name == "torch" else pytest.importorskip("mstar_actors.lora.triton_ops")

def _stacks(device: str) -> dict[str, LoraStack]:
    kw = dict(num_slots=3, max_rank=8, dtype=torch.bfloat16, device=device)
    return {"qkv": LoraStack(64, [64, 16, 16], **kw), "down": LoraStack(128, [64], **kw),
            "embed": LoraStack(100, [64], is_embedding=True, **kw)}


def _modules(seed: int) -> dict[str, list[tuple[int | None, LoraModule]]]:
    g = torch.Generator().manual_seed(seed)

    def module(rank: int, in_features: int, out: int, scale: float) -> LoraModule:
        return LoraModule(a=torch.randn(rank, in_features, generator=g), b=torch.randn(out, rank, generator=g), scale=scale)

    return {"qkv": [(0, module(8, 64, 64, 2.0)), (2, module(4, 64, 16, 0.5))], "down": [(None, module(6, 128, 64, 1.5))]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_install_matches_install_slot_and_clears_what_it_does_not_name():
    staged, plain = _stacks("cuda"), _stacks("cuda")
    staging = SlotStaging(staged, torch.device("cuda"))
    staging.install(1, _modules(1))  # an earlier tenant with other targets ...
    staging.install(1, {"down": _modules(2)["down"]})  # ... is replaced whole
    staging.install(2, _modules(3))
    for name, stack in plain.items():
        stack.install_slot(1, {"down": _modules(2)["down"]}.get(name, ()))
        stack.install_slot(2, _modules(3).get(name, ()))
    for name in staged:
        for got, want in zip((staged[name].a, staged[name].b, staged[name].scales),
                             (plain[name].a, plain[name].b, plain[name].scales)):
            assert torch.equal(got, want), name
    assert not staged["qkv"].a[:, 1].any() and not staged["qkv"].scales[:, 1].any()


def test_stacks_laid_slot_by_slot_stage_and_fuse_the_same_factors():
    """Where the row kernels run, A is laid slot by slot (``fuse_under``'s order, a prefix of slots
    a prefix of the buffer): a staged install and a swap back write the values ``install_slot``
    writes into a stack laid shard by shard, and the fused buffer holds them slot by slot."""
    triton_ops = _kernels("triton")
    kw = dict(num_slots=3, max_rank=8, dtype=torch.float32, device="cpu")
    by_slot = {"qkv": LoraStack(64, [64, 16, 16], kernels=triton_ops, **kw), "down": LoraStack(128, [64], kernels=triton_ops, **kw)}
    plain = {"qkv": LoraStack(64, [64, 16, 16], **kw), "down": LoraStack(128, [64], **kw)}
    assert by_slot["qkv"].a.transpose(0, 1).is_contiguous() and plain["qkv"].a.is_contiguous()
    fused, _ = by_slot["qkv"].fuse_under(torch.zeros(96, 64), None)
    staging = SlotStaging(by_slot, torch.device("cpu"), max_images=2, kernels=triton_ops)
    staging.install(1, _modules(1), key="one")
    staging.install(2, _modules(3), key="three")
    assert staging.reinstall(1, "three") and staging.reinstall(2, "one")
    for name, stack in plain.items():
        stack.install_slot(1, _modules(3).get(name, ()))
        stack.install_slot(2, _modules(1).get(name, ()))
        for got, want in zip(by_slot[name].slot_views(1) + by_slot[name].slot_views(2),
                             stack.slot_views(1) + stack.slot_views(2)):
            assert torch.equal(got, want), name
    slot_rows = by_slot["qkv"].slot_rows
    # Slot 1's A first, right under the weight (slot 0, the zero adapter's, reads no A)
    assert fused.shape[0] == 96 + 2 * slot_rows
    assert torch.equal(fused[96 + slot_rows :], plain["qkv"].a[:, 2].reshape(slot_rows, 64))



def test_fusing_leaves_the_zero_slot_no_rows_and_installs_never_touch_the_weight():
    """The fused buffer holds the weight, then the adapter slots' A (slot 0, the zero adapter, reads
    none: its view is the weight's last rows, which installs, clears and swaps never write)."""
    triton_ops = _kernels("triton")
    stack = LoraStack(64, [64, 16, 16], num_slots=3, max_rank=8, dtype=torch.float32, device="cpu", kernels=triton_ops)
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(5))
    fused, _ = stack.fuse_under(weight.clone(), None)
    assert fused.shape[0] == 96 + 2 * stack.slot_rows and stack.a[:, 1].data_ptr() == fused[96:].data_ptr()
    staging = SlotStaging({"qkv": stack}, torch.device("cpu"), max_images=2, kernels=triton_ops)
    staging.install(1, _modules(1), key="one")
    staging.install(2, _modules(3), key="three")
    stack.clear(1)
    assert staging.reinstall(1, "three") and staging.reinstall(2, "one")
    assert torch.equal(fused[:96], weight)
    for refused in (lambda: stack.clear(0), lambda: stack.install_slot(0, _modules(1)["qkv"]),
                    lambda: stack.install_slot(0, ()), lambda: staging.install(0, {}),
                    lambda: staging.reinstall(0, "one"), stack.keep_half):
        with pytest.raises(ValueError, match="slot 0 is the zero adapter|not fused"):
            refused()
    assert torch.equal(fused[:96], weight)
    out = torch.randn(5, 64) @ fused.T
    assert stack.shrink_fits(stack.fused_shrink(out), 5) and stack.fused_shrink(out).shape[1] == 3 * stack.slot_rows
    with pytest.raises(ValueError, match="at least a slot's"):
        LoraStack(64, [8], num_slots=3, max_rank=16, kernels=triton_ops).fuse_under(torch.zeros(8, 64), None)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_module_that_does_not_fit_is_refused_before_any_device_write():
    stacks = _stacks("cuda")
    staging = SlotStaging(stacks, torch.device("cuda"))
    staging.install(1, _modules(1))
    before = stacks["qkv"].a.clone()
    bad = {"qkv": [(0, LoraModule(a=torch.ones(8, 32), b=torch.ones(64, 8), scale=1.0))]}
    with pytest.raises(ValueError, match="do not fit shard 0"):
        staging.install(1, bad)
    assert torch.equal(stacks["qkv"].a, before)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_kept_images_reinstall_the_same_weights_and_the_oldest_is_dropped(device):
    """Installs keep their images; a reinstall writes what ``install_slot``
    would (the torch kernels' dense copy of B too); the oldest image is
    dropped past ``max_images``; a refused install gives none up."""
    stacks, plain = _stacks(device), _stacks(device)
    staging = SlotStaging(stacks, torch.device(device), max_images=2)
    staging.install(1, _modules(1), key="one")
    staging.install(2, _modules(2), key="two")
    staging.install(1, _modules(3), key="three")  # slot 1 now holds "three"; "one" is dropped (oldest)
    assert not staging.reinstall(2, "one")
    assert staging.reinstall(1, "two") and staging.reinstall(2, "three")
    for name, stack in plain.items():
        stack.install_slot(1, _modules(2).get(name, ()))
        stack.install_slot(2, _modules(3).get(name, ()))
    assert stacks["down"].b_all is not None  # built alone, stacks run the torch kernels, dense copies and all
    assert stacks["down"].targets(1) and not stacks["embed"].targets(1)  # no embedding module: nothing computed there
    image = staging.images["three"]  # what the log line counts for a kept image, B's transpose with it
    assert staging.kept_image_bytes == sum(t.numel() * t.element_size()
                                           for t in (image.flat, image.scales, *(f.b_rows for f in image.kept.values())))
    for name in stacks:
        for field in ("a", "b", "scales", "b_all"):
            got, want = getattr(stacks[name], field), getattr(plain[name], field)
            assert (got is None and want is None) or torch.equal(got, want), (name, field)
        stack = stacks[name]
        if stack.factors is not None:  # the one-slot GEMMs' forms, as the first step on each slot writes them
            want = DenseFactors(stack.a, stack.b, stack.scales, stack.offsets)
            for slot in (1, 2):
                got = stack._factors(slot)
            for field in ("a_t", "b", "scales"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (name, field)
    staging.install(1, _modules(4))  # no key: kept images are untouched
    assert staging.reinstall(2, "two") and list(staging.images) == ["three", "two"]
    before = stacks["qkv"].a.clone()
    bad = {"qkv": [(0, LoraModule(a=torch.ones(8, 32), b=torch.ones(64, 8), scale=1.0))]}
    with pytest.raises(ValueError, match="do not fit shard 0"):
        staging.install(1, bad, key="bad")
    assert torch.equal(stacks["qkv"].a, before) and list(staging.images) == ["three", "two"]


def _assert_slot(stacks, plain, slot: int) -> None:
    for name in stacks:
        for got, want in zip(stacks[name].slot_views(slot), plain[name].slot_views(slot)):
            assert torch.equal(got, want), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_images_beyond_the_device_twins_reinstall_from_the_host_and_take_the_oldest_twin(kernels):
    stacks, plain = _stacks("cuda"), _stacks("cuda")
    staging = SlotStaging(stacks, torch.device("cuda"), max_images=3, device_images=2, kernels=_kernels(kernels))
    assert staging.num_device_images == 2
    for seed, key in ((1, "one"), (2, "two"), (3, "three")):
        staging.install(1, _modules(seed), key=key)  # "three" took "one"'s twin; "one" is kept on the host only
    for rounds in range(2):
        for seed, key in ((1, "one"), (2, "two"), (3, "three")):
            assert staging.reinstall(2, key)
            plain_stack_modules = _modules(seed)
            for name, stack in plain.items():
                stack.install_slot(2, plain_stack_modules.get(name, ()))
            torch.cuda.current_stream().synchronize()
            _assert_slot(stacks, plain, 2)
    assert list(staging.images) == ["one", "two", "three"] and staging.num_device_images == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["device twin", "host image", "install"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_slot_is_written_after_the_steps_queued_before_and_before_those_queued_after(path, kernels):
    """The last steps of a slot's earlier tenant may still be queued on the
    step stream (overlapped scheduling): they must read its weights, and the
    next step the new tenant's, whichever path writes the slot."""
    stacks, plain = _stacks("cuda"), _stacks("cuda")
    staging = SlotStaging(stacks, torch.device("cuda"), max_images=2, device_images=1 if path == "host image" else 2,
                          kernels=_kernels(kernels))
    staging.install(1, _modules(1), key="old")
    staging.install(2, _modules(2), key="new")
    if path == "host image":
        staging.install(2, _modules(3), key="other")  # takes "new"'s only twin: its reinstall goes through the host
    torch.cuda.synchronize()
    old = [view.clone() for stack in stacks.values() for view in stack.slot_views(1)]
    torch.cuda._sleep(200_000_000)  # a long step still running on the step stream ...
    seen_by_old = [view.clone() for stack in stacks.values() for view in stack.slot_views(1)]  # ... reading slot 1
    if path == "install":
        staging.install(1, _modules(2))
    else:
        assert staging.reinstall(1, "new")
    seen_by_next = [view.clone() for stack in stacks.values() for view in stack.slot_views(1)]
    torch.cuda.synchronize()
    for name, stack in plain.items():
        stack.install_slot(1, _modules(2).get(name, ()))
    want = [view for stack in plain.values() for view in stack.slot_views(1)]
    assert all(torch.equal(a, b) for a, b in zip(seen_by_old, old))
    assert all(torch.equal(a, b) for a, b in zip(seen_by_next, want))



def test_bfloat16_halves_follow_every_write_and_the_float_factors_hold_their_values():
    """``keep_half`` (the CPU layer stack's quantized linears): the float32
    factors are rounded to bfloat16 values, slots already written included,
    and the halves hold the same values after installs, a kept image's swap
    back in and a clear; which slots an adapter targets is kept."""
    def float_stacks() -> dict[str, LoraStack]:
        kw = dict(num_slots=3, max_rank=8, dtype=torch.float32, device="cpu")
        return {"qkv": LoraStack(64, [64, 16, 16], **kw), "down": LoraStack(128, [64], **kw)}

    stacks, plain = float_stacks(), float_stacks()
    staging = SlotStaging(stacks, torch.device("cpu"), max_images=2)
    staging.install(1, _modules(1), key="one")
    stacks["qkv"].set_targeted(2, False)
    halves = {name: stack.keep_half() for name, stack in stacks.items()}
    staging.install(2, _modules(2), key="two")
    assert staging.reinstall(1, "two") and staging.reinstall(2, "one")  # both swapped, each from its image
    stacks["down"].clear(1)
    for stack in plain.values():
        stack.install_slot(2, ())
    for name, stack in plain.items():
        stack.install_slot(1, _modules(2).get(name, ()))
        stack.install_slot(2, _modules(1).get(name, ()))
    plain["down"].clear(1)
    for name, stack in stacks.items():
        a_half, bt_half = halves[name]
        assert stack.half is halves[name] and a_half.dtype == bt_half.dtype == torch.bfloat16
        want = plain[name]
        for got, ref in ((stack.a, want.a), (stack.b, want.b), (stack.b_all, want.b_all)):
            assert torch.equal(got, ref.to(torch.bfloat16).float()), name  # the values of the halves ...
        assert torch.equal(a_half.float(), stack.a) and torch.equal(bt_half.float(), stack.b_all), name
        assert torch.equal(stack.scales, want.scales), name  # ... the scales as installed
        assert stack.a[:, 2].any(), name
    assert not stacks["down"].a[:, 1].any() and not halves["down"][1][8:16].any()  # the clear reached the halves
    assert stacks["qkv"].targets(1) and stacks["qkv"].targets(2)
    image = staging.images["two"]  # kept after keep_half: what the start-up log counts, the halves with it
    assert staging.kept_image_bytes == sum(t.numel() * t.element_size() for t in (
        image.flat, image.scales, *(t for forms in image.kept.values() for t in (forms.b_rows, *forms.halves))))
    with pytest.raises(ValueError, match="CPU layer stack"):
        _stacks("cpu")["embed"].keep_half()


def test_keep_half_keeps_what_an_install_said_a_slot_targets():
    stack = LoraStack(64, [64], num_slots=3, max_rank=8)
    stack.set_targeted(2, False)
    stack.keep_half()
    assert stack.targets(1) and not stack.targets(2)
