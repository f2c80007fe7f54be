"""The decoder's layers in one C call (``cpu_stack``) against the Python path
they replace, on one model and paged caches: hidden states and every
layer's cache equal bit for bit for float32, int4 and int4_a8 weights, in
decode steps of one row and several and in steps with prefill chunks; with
adapter rows (LoRA deltas added in C), equal within float32 rounding; and
the steps and models it leaves to the Python path. Through the runner against
``transformers`` (and ``peft``): ``test_runner``'s, ``test_cpu_quant``'s and
the LoRA parity tests' scripted plans run it, and the last test here checks
that the runner takes it."""

from __future__ import annotations

import pytest
import torch

from mstar_actors.models import cpu_attention, cpu_linear, cpu_ops, cpu_quant, cpu_stack
from mstar_actors.models.attention import AttentionMetadata, allocate_kv_cache
from mstar_actors.models.cpu_attention import CpuPagedAttention
from mstar_actors.models.decoder import CausalLM
from mstar_actors.models.lora_layers import enable_lora

from .factories import make_hf_model
from .test_cpu_fast_paths import make_spec

needs_kernels = pytest.mark.skipif(
    any(k() is None for k in (cpu_stack.kernel, cpu_ops.kernel, cpu_attention.kernel, cpu_linear.kernel, cpu_quant.kernel)),
    reason="no AVX-512 or AVX2, or no C compiler here")
needs_dot_kernel = pytest.mark.skipif(not cpu_quant.has_dot_kernel(), reason="int4_a8 runs on the AVX2 kernel only")
QUANTIZATIONS = ["none", "int4", pytest.param("int4_a8", marks=needs_dot_kernel)]
BLOCK_SIZE = 4
NUM_BLOCKS = 64


def make_model(quantization: str, seed: int = 0, **overrides) -> CausalLM:
    """A random model of ``make_spec``'s shape (3 layers, q/k/v bias) on the CPU backend, its weights
    quantized and packed as ``build_runner`` leaves them (the stack not installed yet)."""
    torch.manual_seed(seed)
    model = CausalLM(make_spec(**({"num_layers": 3, "qkv_bias": True} | overrides)), CpuPagedAttention()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.15)
    if quantization != "none":
        model.quantize_cpu_weights(cpu_quant.bits_of(quantization), int8_activations=quantization == "int4_a8")
    model.pack_cpu_weights()
    return model


class Sequences:
    """Sequences whose contexts lie in shuffled blocks of a paged cache (block 0 unused)."""

    def __init__(self, prompt_lens: list[int], seed: int, max_len: int = 24):
        gen = torch.Generator().manual_seed(seed)
        order = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
        per_seq = -(-max_len // BLOCK_SIZE)
        self.tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(len(prompt_lens))]
        self.lens = [0] * len(prompt_lens)
        self.ids = torch.randint(0, 300, (len(prompt_lens), max_len), generator=gen)

    def step(self, query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The next ``query_lens[i]`` tokens of each sequence (0: not in this step): ids, positions, metadata."""
        seqs = [i for i, n in enumerate(query_lens) if n]
        positions = [p for i in seqs for p in range(self.lens[i], self.lens[i] + query_lens[i])]
        seq_of = [i for i in seqs for _ in range(query_lens[i])]
        ids = torch.stack([self.ids[i, p] for i, p in zip(seq_of, positions)])
        for i in seqs:
            self.lens[i] += query_lens[i]
        tables = [self.tables[i][: -(-self.lens[i] // BLOCK_SIZE)] for i in seqs]
        width = max(map(len, tables))
        meta = AttentionMetadata.from_lists(
            slot_mapping=[self.tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for i, p in zip(seq_of, positions)],
            block_tables=[t + [0] * (width - len(t)) for t in tables], num_blocks=[len(t) for t in tables],
            query_lens=[query_lens[i] for i in seqs], context_lens=[self.lens[i] for i in seqs], device="cpu")
        return ids, torch.tensor(positions), meta


def run_both(model: CausalLM, steps: list[list[int]], seed: int, before_step=None):
    """Each step through the stack and through the Python path, from the same
    cache (the Python path's, copied): yields (stack's hidden, Python's,
    stack's caches, Python's). ``before_step(query_lens)`` runs first (a LoRA step's rows)."""
    assert cpu_stack.install(model)
    stack = model.run_layers
    spec = model.spec
    caches = [allocate_kv_cache(spec.num_layers, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim,
                                torch.float32, "cpu") for _ in range(2)]
    seqs = Sequences(steps[0], seed, max_len=max(24, *map(sum, zip(*steps))))
    calls = []
    stack.run = lambda *args, run=stack.run: calls.append(1) or run(*args)
    with torch.inference_mode():
        for query_lens in steps:
            if before_step is not None:
                before_step(query_lens)
            ids, positions, meta = seqs.step(query_lens)
            x = model.model.embed_tokens(ids)
            for mine, theirs in zip(*caches):
                mine.copy_(theirs)
            got = stack(x, positions, caches[0], meta)
            meta.derived.clear()
            want = stack.fallback(x, positions, caches[1], meta)
            yield got, want, caches[0], caches[1]
    assert len(calls) == len(steps)  # every step took the one call


STEPS = {
    # prompts, then decode steps across block boundaries (blocks of 4, contexts up to 18 tokens)
    "decode, 1 row": [[9]] + [[1]] * 5,
    "decode, 3 rows": [[9, 13, 6]] + [[1, 1, 1]] * 5,
    # whole prompts, then chunks (after a cached prefix too) beside decode rows
    "prefill chunks": [[7, 5, 0], [1, 1, 6], [1, 3, 1], [1, 1, 1]],
}


@needs_kernels
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("steps", list(STEPS.values()), ids=list(STEPS))
def test_steps_equal_the_python_path_bit_for_bit(quantization, steps):
    for got, want, got_caches, want_caches in run_both(make_model(quantization), steps, seed=len(steps[0])):
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches, strict=True))


@needs_kernels
def test_steps_it_cannot_take_run_the_python_path():
    model = make_model("none")
    assert cpu_stack.install(model)
    stack = model.run_layers
    seqs = Sequences([5, 5], seed=0)
    ids, positions, meta = seqs.step([5, 5])
    with torch.inference_mode():
        x = model.model.embed_tokens(ids)
        assert stack.takes(x, positions, meta)
        assert not stack.takes(x.double(), positions, meta)
        assert not stack.takes(x, positions.expand(3, -1), meta)  # M-RoPE's positions
        meta.graph_decode = True
        assert not stack.takes(x, positions, meta)
        meta.graph_decode = False
    assert not stack.takes(x, positions, meta)  # autograd on


def random_adapters(model: CausalLM, num_slots: int = 4, rank: int = 4, seed: int = 0):
    """LoRA stacks on every linear (``enable_lora``) with random factors in slots
    1..num_slots-2 (the last left empty), rank ``rank`` of ``rank + 2``."""
    layers = enable_lora(model, None, num_slots=num_slots, max_rank=rank + 2, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    for stack in layers.stacks.values():
        for slot in range(1, num_slots - 1):
            stack.a[:, slot, :rank].copy_(torch.randn(stack.a[:, slot, :rank].shape, generator=gen) * 0.2)
            stack.b[slot, :, :rank].copy_(torch.randn(stack.b[slot, :, :rank].shape, generator=gen) * 0.2)
            stack.scales[:, slot] = 0.5 + slot
            stack.write_dense(slot)
    return layers


LORA_STEPS = {
    # (query lens, each sequence's slot): decode rows of one adapter, of two beside a base row, and prompts
    "decode, one adapter": ([[6]] + [[1]] * 4, [1]),
    "decode, mixed": ([[6, 7, 5]] + [[1, 1, 1]] * 4, [1, 0, 2]),
    "prefill chunks, mixed": ([[7, 5, 3], [1, 1, 6], [1, 3, 1]], [2, 1, 0]),
    "an empty slot": ([[4, 4]] + [[1, 1]] * 2, [3, 1]),
    # one adapter's rows past a block of the shrink's (``LORA_ROW_BLOCK``, 64), beside another's
    "long prompts, mixed": ([[70, 9, 5]] + [[1, 1, 1]], [1, 2, 1]),
}


# Widths past the delta's vector tiles (``lora_shrink_tile``, ``lora_expand_tile``): inputs not a
# multiple of 8, shards' outputs not of 16 nor 8 (float32 linears: int4 codes take multiples of 32).
ODD_WIDTHS = dict(hidden_size=72, num_heads=4, num_kv_heads=2, head_dim=18, intermediate_size=100)


@needs_kernels
@pytest.mark.parametrize("quantization, widths", [("none", {}), ("int4", {}), ("none", ODD_WIDTHS)],
                         ids=["none", "int4", "none, odd widths"])
@pytest.mark.parametrize("case", list(LORA_STEPS.values()), ids=list(LORA_STEPS))
def test_adapter_steps_add_the_python_paths_deltas(quantization, widths, case):
    """Steps with adapter rows take the call too, each linear's LoRA delta added
    in it (``lora_delta``): hidden states and caches as the Python path's, whose
    deltas are GEMMs over the rows (float32 sums in another order). Quantized
    linears read their factors in bfloat16, which the Python path's hold the
    values of (``LoraStack.keep_half``)."""
    steps, slots = case
    model = make_model(quantization, **widths)
    layers = random_adapters(model)
    assert cpu_stack.install(model) and model.run_layers.plan.max_width == 3 * 6  # q|k|v: three shards of rank 6
    descs = model.run_layers.plan.desc.layers[:model.spec.num_layers]
    halves = [getattr(desc, name).lora_half for desc in descs for name in ("qkv", "o", "gate_up", "down")]
    quantized = [m.quant is not None for layer in model.model.layers
                 for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert halves == quantized and any(quantized) == (quantization != "none")
    outputs = []
    with torch.inference_mode():
        for got, want, got_caches, want_caches in run_both(model, steps, seed=3,
                                                           before_step=lambda q: begin(layers, q, slots)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for a, b in zip(got_caches, want_caches, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            outputs.append(got)
        layers.end_step()
        # the deltas are there: the same steps without adapters differ (every case has rows on slot 1 or 2)
        plain = [got for got, _, _, _ in run_both(make_model(quantization, **widths), steps, seed=3)]
    assert max((a - b).abs().max().item() for a, b in zip(outputs, plain, strict=True)) > 1e-2


def begin(layers, query_lens: list[int], slots: list[int]) -> None:
    """``begin_step`` as the runner calls it: the chunks of this step, each on its sequence's slot."""
    chunk_slots = [slot for n, slot in zip(query_lens, slots) if n]
    lens = [n for n in query_lens if n]
    layers.begin_step(chunk_slots, lens, chunk_slots)


@needs_kernels
def test_adapter_steps_it_cannot_take_run_the_python_path():
    """Rows by device slots (CUDA's form) leave the call; base-only steps and
    adapter rows by host slots, a long prompt's too, stay."""
    model = make_model("none")
    layers = random_adapters(model)
    assert cpu_stack.install(model)
    stack = model.run_layers
    ids, positions, meta = Sequences([5], seed=0).step([5])
    with torch.inference_mode():
        x = model.model.embed_tokens(ids)
        layers.begin_step([0], [5], [0])  # base rows only
        assert stack.takes(x, positions, meta)
        layers.begin_step([1], [5], [1])
        assert stack.takes(x, positions, meta)
        layers.begin_rows_step(torch.ones(5, dtype=torch.int32))
        assert not stack.takes(x, positions, meta)
        layers.end_step()
        many = torch.zeros(1000, x.shape[1])
        layers.begin_step([1], [many.shape[0]], [1])
        assert stack.takes(many, torch.arange(many.shape[0]), meta)
        layers.end_step()


@needs_kernels
def test_hooks_of_different_steps_are_refused():
    """Hooks set after the plan remake it; hooks that do not share one step
    leave the stack for good."""
    model = make_model("none")
    layers = random_adapters(model)
    assert cpu_stack.install(model)
    stack = model.run_layers
    ids, positions, meta = Sequences([5], seed=0).step([5])
    linears = [m for m in model.model.layers.modules() if hasattr(m, "lora") and hasattr(m, "in_features")]
    assert len(linears) == 4 * model.spec.num_layers
    with torch.inference_mode():
        x = model.model.embed_tokens(ids)
        assert stack.takes(x, positions, meta) and stack.plan.hook is linears[0].lora
        linears[0].lora = type(linears[1].lora)(linears[0].lora.stack, type(layers.step)())  # a step of its own
        assert not stack.takes(x, positions, meta) and stack.plan is None
        linears[0].lora = linears[1].lora
        assert not stack.takes(x, positions, meta)


@needs_kernels
def test_models_it_cannot_take_are_refused():
    assert not cpu_stack.install(make_model("none", qk_norm=True))  # Qwen3's per-head norms
    assert not cpu_stack.install(CausalLM(make_spec()).eval())  # the torch attention backend
    assert cpu_stack.install(make_model("none"))


@needs_kernels
@pytest.mark.parametrize("kind, quantization", [("llama-bias", "none"), ("llama3-tied", "int4")])
def test_the_runner_takes_it_and_matches_generate(kind, quantization, tmp_path):
    """``test_runner``'s scripted plans (chunked prefill, prefix hits,
    preemption, decode) through the stack, against ``transformers``."""
    from . import test_cpu_quant
    from .test_runner import make_runner, reference, run_script

    hf = make_hf_model(kind, tmp_path / "float")
    if quantization != "none":
        test_cpu_quant.round_through(hf, cpu_quant.bits_of(quantization))
    hf.save_pretrained(tmp_path / "model")
    runner = make_runner(tmp_path / "model", quantization=quantization)
    stack = runner.model.run_layers
    assert isinstance(stack, cpu_stack.CpuDecoderStack)
    calls = []
    stack.run = lambda *args, run=stack.run: calls.append(1) or run(*args)
    outputs, prompts = run_script(runner)
    assert len(calls) > 10
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference(hf, prompt), f"sequence {rid} diverged"


@needs_kernels
@pytest.mark.parametrize("half", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 9, 70])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_delta_matches_the_reference_at_widths_and_row_counts_off_its_tiles(half, num_rows, num_threads):
    """``lora_delta`` alone: inputs and shard widths off its vector tiles (8 inputs, 16 and 8 outputs),
    ranks off its groups of four A rows, row counts off its tiles of two and four rows; every row
    on an adapter, one slot's rows or both slots' in turn, float32 or bfloat16 factors."""
    lib = cpu_stack.kernel()
    stack, x, _ = cpu_stack.lora_case(37, [7, 19, 40], 6, num_rows=num_rows, half=half, seed=num_rows)
    for row_slots in (torch.ones(num_rows, dtype=torch.int64), torch.arange(num_rows, dtype=torch.int64) % 2 + 1):
        got, want = cpu_stack.lora_delta(lib, stack, x, row_slots, num_threads=num_threads)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert want.abs().max() > 1.0
