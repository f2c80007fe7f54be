"""The decoder's CPU fast paths against the plain ops they replace, and where
each one is (and is not) taken: packed linears and LM head (our AVX-512
kernel, oneDNN as its fallback), rotary tables once per forward, fused
RMSNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar_actors.models import cpu_linear, decoder
from mstar_actors.models.attention import AttentionMetadata, allocate_kv_cache
from mstar_actors.models.decoder import CausalLM, LoraLinear, RMSNorm, StackedLinear
from mstar_actors.models.rope import RotaryEmbedding, _rotate_half, rotate
from mstar_actors.models.spec import ModelSpec, RopeSpec

needs_onednn = pytest.mark.skipif(not cpu_linear.is_available(), reason="this torch build has no oneDNN packed linear")
needs_kernel = pytest.mark.skipif(cpu_linear.kernel() is None, reason="no AVX-512 or AVX2, or no C compiler here: the kernel is off")
only_onednn = pytest.mark.skipif(not cpu_linear.is_onednn_available(), reason="this torch build has no oneDNN packed linear")
BLOCK_SIZE = 16


def make_spec(**overrides) -> ModelSpec:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
                  rope=RopeSpec(theta=10000.0), tie_word_embeddings=True)
    return ModelSpec(**{**fields, **overrides})


def make_model(seed: int = 0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(make_spec(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.15)
    return model


def prefill_meta(num_tokens: int) -> AttentionMetadata:
    """One sequence's whole prompt in blocks 1.. of an empty cache."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    blocks = list(range(1, num_blocks + 1))
    return AttentionMetadata(
        slot_mapping=torch.tensor([blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(num_tokens)]),
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        query_start=torch.tensor([0, num_tokens], dtype=torch.int32),
        context_lens=torch.tensor([num_tokens], dtype=torch.int32),
        query_lens_list=[num_tokens], context_lens_list=[num_tokens], num_blocks_list=[num_blocks],
    )


def run_forward(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    spec = model.spec
    caches = allocate_kv_cache(spec.num_layers, 8, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), caches, prefill_meta(len(ids)))
        return model.compute_logits(hidden[-3:])


class AddOne:
    """A stand-in LoRA hook: its delta is +1 everywhere, so it shows whether it ran."""

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y + 1


# -- packed linear ---------------------------------------------------------------------


@needs_onednn
@pytest.mark.parametrize("num_rows", [1, 3, 8, 40])
@pytest.mark.parametrize("has_bias", [False, True])
def test_packed_linear_matches_f_linear(num_rows, has_bias):
    torch.manual_seed(num_rows)
    x, w = torch.randn(num_rows, 96), torch.randn(200, 96)
    b = torch.randn(200) if has_bias else None
    with torch.no_grad():
        got = cpu_linear.packed_linear(x, w, b, cpu_linear.PackedWeight())
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_packable_only_on_cpu_float32_without_autograd():
    w = torch.randn(8, 4)
    with torch.no_grad():
        assert cpu_linear.is_packable(torch.randn(2, 4), w) == cpu_linear.is_available()
        assert not cpu_linear.is_packable(torch.randn(2, 4, dtype=torch.float64), w.double())
        assert not cpu_linear.is_packable(torch.randn(2, 4, dtype=torch.bfloat16), w.bfloat16())
        assert not cpu_linear.is_packable(torch.randn(2, 4, device="meta"), w.to("meta"))
    assert not cpu_linear.is_packable(torch.randn(2, 4), w)  # autograd on: the oneDNN op has no backward


@needs_onednn
def test_packed_weight_follows_in_place_change_and_swap():
    layer = LoraLinear(16, 8, bias=False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        first = layer(x)
        assert layer.packed is not None
        layer.weight.mul_(2)  # in place: a new version
        torch.testing.assert_close(layer(x), 2 * first, rtol=1e-5, atol=1e-5)
        layer.weight.data = torch.randn(8, 16)  # another storage
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_lora_linear_takes_packed_path_and_still_adds_the_delta():
    layer = StackedLinear(16, [8, 4], bias=True)
    layer.lora = AddOne()
    x = torch.randn(5, 16)
    with torch.inference_mode():
        got = layer(x)
    assert layer.packed is not None
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias) + 1, rtol=1e-5, atol=1e-5)


def test_lora_linear_with_autograd_or_float64_keeps_f_linear():
    layer = LoraLinear(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()  # the plain path, so gradients flow
    assert x.grad is not None and layer.packed is None
    with torch.no_grad():
        layer64 = LoraLinear(16, 8).double()
        layer64(torch.randn(3, 16, dtype=torch.float64))
    assert layer64.packed is None


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_packed_matches_f_linear_and_adds_lora(tied):
    model = make_model(tie_word_embeddings=tied)
    hidden = torch.randn(3, 64)
    weight = model.model.embed_tokens.weight if tied else model.lm_head.weight
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        assert model.lm_head_packed is not None
        model.lm_head_lora = AddOne()
        with_lora = model.compute_logits(hidden)
    torch.testing.assert_close(logits, F.linear(hidden, weight), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(with_lora, logits + 1)


@needs_onednn
def test_model_logits_match_plain_ops(monkeypatch):
    model = make_model()
    ids = torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(3))
    fast = run_forward(model, ids)
    assert all(m.packed is not None for m in model.modules() if isinstance(m, LoraLinear))
    monkeypatch.setattr(decoder, "is_packable", lambda x, w: False)
    plain = run_forward(model, ids)
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)


# -- our kernel ------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("num_out", [32, 40, 200])
@pytest.mark.parametrize("has_bias", [False, True])
def test_kernel_matches_f_linear(num_rows, num_out, has_bias):
    """Row counts around the 8-row groups, column counts around the 32-column blocks."""
    gen = torch.Generator().manual_seed(num_rows * 1000 + num_out)
    x, w = torch.randn(num_rows, 72, generator=gen), torch.randn(num_out, 72, generator=gen)
    b = torch.randn(num_out, generator=gen) if has_bias else None
    with torch.no_grad():
        cache = cpu_linear.PackedWeight()
        got = cpu_linear.packed_linear(x, w, b, cache)
    assert cache.packed.shape == (-(-num_out // 32), 72, 32)  # the kernel's blocks, zero-padded
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_kernel_takes_strided_and_batched_inputs():
    w, b = torch.randn(48, 16), torch.randn(48)
    wide = torch.randn(6, 40)
    batched = torch.randn(2, 3, 16)
    with torch.no_grad():
        cache = cpu_linear.PackedWeight()
        torch.testing.assert_close(cpu_linear.packed_linear(wide[:, 4:20], w, b, cache), F.linear(wide[:, 4:20], w, b))
        columns = wide[:, :16].t().contiguous().t()  # column-major rows
        torch.testing.assert_close(cpu_linear.packed_linear(columns, w, b, cache), F.linear(columns, w, b))
        torch.testing.assert_close(cpu_linear.packed_linear(batched, w, b, cache), F.linear(batched, w, b))
        assert cpu_linear.packed_linear(torch.empty(0, 16), w, b, cache).shape == (0, 48)


@needs_kernel
def test_kernel_threads_split_columns_without_changing_a_bit():
    x, w = torch.randn(5, 64), torch.randn(4096, 64)
    cache = cpu_linear.PackedWeight()
    threads = torch.get_num_threads()
    with torch.no_grad():
        try:
            torch.set_num_threads(1)
            one = cpu_linear.packed_linear(x, w, None, cache)
            torch.set_num_threads(2)
            two = cpu_linear.packed_linear(x, w, None, cache)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_pack_blocks_layout():
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    blocks = cpu_linear.pack_blocks(w)
    assert blocks.shape == (2, 3, 32)
    assert torch.equal(blocks[1, 2, :8], w[32:, 2]) and not blocks[1, :, 8:].any()  # zero columns pad the last block
    assert torch.equal(blocks[0].t(), w[:32])


@only_onednn
def test_without_the_kernel_weights_pack_for_onednn_and_agree(monkeypatch):
    x, w, b = torch.randn(8, 64), torch.randn(96, 64), torch.randn(96)
    monkeypatch.setattr(cpu_linear, "_use_kernel", False)
    with torch.no_grad():
        cache = cpu_linear.PackedWeight()
        got = cpu_linear.packed_linear(x, w, b, cache)
    assert cache.packed.dim() == 2  # oneDNN's copy, which packed_linear then reads
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, caplog):
    def no_compiler(name, source, isa="avx512"):
        raise cpu_linear.KernelUnavailable("no C compiler found (cc, gcc or $CC)")

    monkeypatch.setattr(cpu_linear, "build_library", no_compiler)
    monkeypatch.setattr(cpu_linear, "kernel_isa", lambda choices: choices[0])  # as if the CPU had it
    cpu_linear.kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=cpu_linear.__name__):
            assert cpu_linear.kernel() is None and cpu_linear.kernel() is None
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "no C compiler found" in warnings[0] and "oneDNN" in warnings[0]
        assert cpu_linear.is_available() == cpu_linear.is_onednn_available()
    finally:
        cpu_linear.kernel.cache_clear()  # the next caller builds (or finds) the real one again


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setattr(cpu_linear, "find_compiler", lambda: None)
    monkeypatch.setattr(cpu_linear, "_cpu_has_avx512", lambda: True)
    with pytest.raises(cpu_linear.KernelUnavailable, match="no C compiler found"):
        cpu_linear.build_library("cpu_linear", cpu_linear.KERNEL_SOURCE)


def test_a_failing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_linear, "find_compiler", lambda: str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_linear, "cache_root", lambda: tmp_path / "models")
    monkeypatch.setattr(cpu_linear, "_cpu_has_avx512", lambda: True)
    with pytest.raises(cpu_linear.KernelUnavailable, match="no-such-cc"):
        cpu_linear.build_library("cpu_linear", cpu_linear.KERNEL_SOURCE)


def test_the_best_instruction_set_the_cpu_has_is_built(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_cpu_has_avx512", lambda: False)
    monkeypatch.setattr(cpu_linear, "_cpu_has_avx2", lambda: True)
    assert cpu_linear.kernel_isa() == "avx2" and cpu_linear.kernel_isa(("avx512",)) is None
    monkeypatch.setattr(cpu_linear, "_cpu_has_avx512", lambda: True)
    assert cpu_linear.kernel_isa() == "avx512"
    with pytest.raises(cpu_linear.KernelUnavailable, match="no avx512"):
        monkeypatch.setattr(cpu_linear, "_cpu_has_avx512", lambda: False)
        cpu_linear.build_library("cpu_linear", cpu_linear.KERNEL_SOURCE, "avx512")


def test_pack_blocks_into_a_given_buffer_equals_its_own():
    w = torch.randn(70, 9)
    out = torch.full(cpu_linear.blocks_shape(w), float("nan"))
    assert cpu_linear.pack_blocks(w, out) is out
    assert torch.equal(out, cpu_linear.pack_blocks(w))  # padding columns zeroed, not left as they were


def test_pack_arena_hands_out_aligned_disjoint_slices():
    weights = [torch.randn(40, 24), torch.randn(64, 8), torch.randn(3, 5)]
    arena = cpu_linear.PackArena(cpu_linear.arena_floats(weights))
    pieces = [arena.take(cpu_linear.blocks_shape(w)) for w in weights]
    assert all(p.data_ptr() % 64 == 0 for p in pieces)
    assert pieces[0].data_ptr() % cpu_linear.HUGE_PAGE == 0  # the first starts a 2 MiB page
    for piece, w in zip(pieces, weights, strict=True):
        cpu_linear.pack_blocks(w, piece)
    for piece, w in zip(pieces, weights, strict=True):  # none overwrote another
        assert torch.equal(piece, cpu_linear.pack_blocks(w))
    with pytest.raises(ValueError, match="do not fit"):
        arena.take((1, 1, 32))


@needs_kernel
def test_pack_cpu_weights_puts_every_copy_in_one_arena():
    model = make_model(tie_word_embeddings=False)
    model.pack_cpu_weights()
    copies = [m.packed.packed for m in model.modules() if isinstance(m, LoraLinear)] + [model.lm_head_packed.packed]
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    assert all(c.dim() == 3 for c in copies)
    hidden = torch.randn(3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.lm_head.weight), rtol=1e-5, atol=1e-4)


# -- rotary --------------------------------------------------------------------------


def test_rotate_is_bit_identical_to_rotate_half():
    rotary = RotaryEmbedding(RopeSpec(theta=10000.0), 16)
    positions = torch.tensor([0, 5, 17, 200])
    x = torch.randn(4, 3, 16)
    cos, signed_sin = rotary.tables(positions, torch.float32)
    sin = torch.cat((signed_sin[..., 8:], signed_sin[..., 8:]), dim=-1)
    assert torch.equal(rotate(x, cos, signed_sin), x * cos + _rotate_half(x) * sin)


def test_layers_share_one_rotary_whose_tables_last_one_forward():
    model = make_model()
    rotaries = {id(layer.self_attn.rotary) for layer in model.model.layers}
    assert len(rotaries) == 1
    computed = []
    original = RotaryEmbedding.tables

    def spy(self, positions, dtype):
        computed.append(len(positions))
        return original(self, positions, dtype)

    with pytest.MonkeyPatch.context() as mp:  # on the torch rotary and the fused C call alike
        mp.setattr(RotaryEmbedding, "tables", spy)
        run_forward(model, torch.arange(5))
    assert computed == [5]  # once for the forward, not once a layer
    assert model.model.layers[0].self_attn.rotary.step_tables is None


def test_step_tables_are_cleared_when_a_layer_fails():
    model = make_model()
    with pytest.raises(ValueError), torch.inference_mode():
        model.run_layers(torch.randn(3, 64), torch.arange(3), [], prefill_meta(3))  # no KV caches: zip fails
    assert model.model.layers[0].self_attn.rotary.step_tables is None


def test_per_layer_rotary_still_works_when_replaced():
    """A model that gives each layer its own rotary (as M-RoPE does) gets the same result."""
    model = make_model()
    ids = torch.arange(7)
    shared = run_forward(model, ids)
    for layer in model.model.layers:
        layer.self_attn.rotary = RotaryEmbedding(model.spec.rope, model.spec.head_dim)
    assert torch.equal(run_forward(model, ids), shared)


# -- RMSNorm -------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows", [1, 8, 33])
def test_rms_norm_fast_path_is_bit_identical_in_float32(num_rows):
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(num_rows, 576) * 7
    expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(norm(x), expected)


def test_rms_norm_bfloat16_keeps_the_reference_casts():
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(norm(x), expected)


@needs_onednn
def test_pack_cpu_weights_packs_ahead_and_the_forward_reuses_the_copies():
    model = make_model()
    num_bytes = model.pack_cpu_weights()
    linears = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert num_bytes == sum(m.weight.nbytes for m in linears) + model.model.embed_tokens.weight.nbytes
    copies = [m.packed.packed for m in linears] + [model.lm_head_packed.packed]
    run_forward(model, torch.arange(4))
    after = [m.packed.packed for m in linears] + [model.lm_head_packed.packed]
    assert all(a is b for a, b in zip(after, copies, strict=True))  # none made again
    assert make_model().to(torch.float64).pack_cpu_weights() == 0
