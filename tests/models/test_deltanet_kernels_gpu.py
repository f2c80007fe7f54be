"""The Triton Gated DeltaNet ops (fla-core's chunked kernel, our decode kernel and conv)
against the torch reference on fresh random inputs and pools (CUDA only).

Each step mixes prefill chunks of 2 .. 300 tokens, fresh (context == chunk)
and continuing from their slot's state, with single-token decode rows; the
reference runs in float32 on the same (upcast) inputs and pools, and both
the outputs and every pool slot (touched or not) are compared. Two steps run
back to back on the same pools (a second call with another chunk layout),
and a pure decode step is captured in a CUDA graph and replayed with new
slots, lengths and inputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mstar_actors.models.attention import AttentionMetadata
from mstar_actors.models.deltanet_ops import Gates, StatePool, TorchDeltaNetOps, static_step_plan

pytestmark = pytest.mark.gpu

# ||triton - reference|| / ||reference||; the fp32 bound leaves room for the
# chunked kernels' tf32 products.
TOL = {torch.float32: 3e-3, torch.bfloat16: 1e-2}
DK = DV = 128
KERNEL = 4
NUM_SLOTS = 24


@pytest.fixture(scope="module")
def ops():
    module = pytest.importorskip("mstar_actors.models.deltanet_triton")
    return module.TritonDeltaNetOps()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_meta(query_lens, context_lens, slots, device) -> AttentionMetadata:
    meta = AttentionMetadata.from_lists(slot_mapping=[0] * sum(query_lens), block_tables=[[0]] * len(query_lens),
                                        num_blocks=[1] * len(query_lens), query_lens=query_lens,
                                        context_lens=context_lens, device=device)
    meta.state_slots = torch.tensor(slots, dtype=torch.long, device=device)
    meta.state_slots_list = list(slots)
    return meta


def random_step(gen, query_lens, fresh, device):
    """A step's metadata: distinct random slots; a continuing sequence has a prefix before its chunk."""
    slots = torch.randperm(NUM_SLOTS, generator=gen)[: len(query_lens)].tolist()
    context = [n if f else n + int(torch.randint(1, 500, (1,), generator=gen)) for n, f in zip(query_lens, fresh)]
    return make_meta(query_lens, context, slots, device)


def random_pool(gen, conv_dim, num_v_heads, dtype, device) -> StatePool:
    conv = torch.randn(NUM_SLOTS + 1, conv_dim, KERNEL - 1, generator=gen)
    ssm = torch.randn(NUM_SLOTS + 1, num_v_heads, DK, DV, generator=gen) * 0.1
    return StatePool(conv.to(device, dtype), ssm.to(device))


def random_inputs(gen, num_tokens, num_k_heads, num_v_heads, dtype, device):
    conv_dim = 2 * num_k_heads * DK + num_v_heads * DV
    x = torch.randn(num_tokens, conv_dim, generator=gen)
    weight = torch.randn(conv_dim, KERNEL, generator=gen) / KERNEL**0.5
    q = torch.randn(num_tokens, num_k_heads, DK, generator=gen)
    k = torch.randn(num_tokens, num_k_heads, DK, generator=gen)
    v = torch.randn(num_tokens, num_v_heads, DV, generator=gen)
    # The gates raw, as in_proj yields a and b (Gates: decay and beta computed by the ops)
    a = torch.randn(num_tokens, num_v_heads, generator=gen) * 2
    b = torch.randn(num_tokens, num_v_heads, generator=gen) * 2
    a_log = torch.rand(num_v_heads, generator=gen) * 2 - 1
    dt_bias = torch.randn(num_v_heads, generator=gen)
    cast = [t.to(device, dtype) for t in (x, weight, q, k, v, a, b)]
    return (*cast, a_log.to(device), dt_bias.to(device, dtype))


def gates_of(inputs, dtype=None) -> Gates:
    return Gates(*(t if dtype is None else t.to(dtype) for t in inputs[5:]))


def copy_pool(pool: StatePool, dtype=None) -> StatePool:
    return StatePool(pool.conv.to(dtype or pool.conv.dtype, copy=True), pool.ssm.clone())


def run_both(ops, meta, inputs, pool, ref_pool):
    """One layer's conv then delta rule on both op sets; the reference in float32."""
    x, weight, q, k, v = inputs[:5]
    fresh_meta = lambda: dataclasses.replace(meta, derived={})  # noqa: E731  each op set derives its own
    got = (ops.conv(x, weight, pool, fresh_meta()), ops.delta_rule(q, k, v, gates_of(inputs), pool, fresh_meta()))
    ref_ops, m = TorchDeltaNetOps(), fresh_meta()
    want = (ref_ops.conv(x.float(), weight.float(), ref_pool, m),
            ref_ops.delta_rule(q.float(), k.float(), v.float(), gates_of(inputs, torch.float32), ref_pool, m))
    return got, want


def check(got, want, pool, ref_pool, dtype, what):
    tol = TOL[dtype]
    errors = {"conv": rel_err(got[0], want[0]), "delta_rule": rel_err(got[1], want[1]),
              "pool.conv": rel_err(pool.conv, ref_pool.conv), "pool.ssm": rel_err(pool.ssm, ref_pool.ssm)}
    assert got[0].dtype == got[1].dtype == dtype
    assert all(e < tol for e in errors.values()), f"{what}: {errors} (tolerance {tol})"
    assert torch.isfinite(got[1]).all()


MIXED = ([1, 37, 1, 300, 64, 1, 2, 129, 1, 65], [False, True, False, False, True, False, True, True, True, False])


# Every (dtype, heads) pair compiles and autotunes the chunked kernels anew: GVA
# in both dtypes, equal heads in bf16 (the head mapping is dtype-blind).
@pytest.mark.parametrize("dtype, heads", [(torch.float32, (2, 4)), (torch.bfloat16, (2, 4)), (torch.bfloat16, (4, 4))],
                         ids=["fp32-hk2-hv4", "bf16-hk2-hv4", "bf16-hk4-hv4"])
def test_mixed_steps_match_reference_twice_in_a_row(ops, dtype, heads):
    """Two mixed steps back to back on one pool set: the second continues the
    first's sequences in another layout (the case a stale chunk index broke)."""
    gen = torch.Generator().manual_seed(1234 + heads[0])
    num_k, num_v = heads
    conv_dim = 2 * num_k * DK + num_v * DV
    pool = random_pool(gen, conv_dim, num_v, dtype, "cuda")
    ref_pool = copy_pool(pool, torch.float32)
    first = random_step(gen, *MIXED, "cuda")
    steps = [first,  # then the same slots continue, with new chunk lengths, decode rows and fresh ones
             make_meta([5, 1, 1, 200, 1, 33, 1, 17, 1, 2],
                       [c + n for c, n in zip(first.context_lens_list, [5, 1, 1, 200, 1, 33, 1, 17, 1, 2])],
                       first.state_slots_list, "cuda")]
    for i, meta in enumerate(steps):
        inputs = random_inputs(gen, sum(meta.query_lens_list), num_k, num_v, dtype, "cuda")
        got, want = run_both(ops, meta, inputs, pool, ref_pool)
        check(got, want, pool, ref_pool, dtype, f"step {i}")


@pytest.mark.parametrize("query_lens", [[300], [1] * 7, [2, 3, 64, 65, 128]], ids=["one-chunk", "decode", "short"])
def test_single_kind_steps(ops, query_lens):
    gen = torch.Generator().manual_seed(len(query_lens))
    pool = random_pool(gen, 2 * 2 * DK + 4 * DV, 4, torch.bfloat16, "cuda")
    ref_pool = copy_pool(pool, torch.float32)
    for fresh in (True, False):
        meta = random_step(gen, query_lens, [fresh] * len(query_lens), "cuda")
        inputs = random_inputs(gen, sum(query_lens), 2, 4, torch.bfloat16, "cuda")
        got, want = run_both(ops, meta, inputs, pool, ref_pool)
        check(got, want, pool, ref_pool, torch.bfloat16, f"fresh={fresh}")


def test_pure_decode_step_replays_from_a_cuda_graph(ops):
    """A graph_decode step (tensors only) captured once, replayed with new slots,
    lengths (one padded row fresh on the scratch slot) and inputs, equals the
    eager Triton step and the reference."""
    gen = torch.Generator().manual_seed(7)
    batch, num_k, num_v, dtype = 8, 2, 4, torch.bfloat16
    conv_dim = 2 * num_k * DK + num_v * DV
    pool = random_pool(gen, conv_dim, num_v, dtype, "cuda")
    static_in = random_inputs(gen, batch, num_k, num_v, dtype, "cuda")
    static_meta = dataclasses.replace(make_meta([1] * batch, [5] * batch, list(range(batch)), "cuda"),
                                      query_lens_list=[], context_lens_list=[], state_slots_list=[],
                                      graph_decode=True)

    def step():
        x, weight, q, k, v = static_in[:5]
        return ops.conv(x, weight, pool, static_meta), ops.delta_rule(q, k, v, gates_of(static_in), pool, static_meta)

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # compile and autotune outside the capture
        step()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for round_ in range(2):
        slots = torch.randperm(NUM_SLOTS, generator=gen)[:batch].tolist()
        context = [int(c) for c in torch.randint(2, 400, (batch,), generator=gen)]
        slots[-1], context[-1] = NUM_SLOTS, 1  # a padded row: scratch slot, fresh state
        inputs = random_inputs(gen, batch, num_k, num_v, dtype, "cuda")
        for dst, src in zip(static_in, inputs):
            dst.copy_(src)
        static_meta.state_slots.copy_(torch.tensor(slots))
        static_meta.context_lens.copy_(torch.tensor(context, dtype=torch.int32))
        eager_pool, ref_pool = copy_pool(pool), copy_pool(pool, torch.float32)
        graph.replay()
        eager_meta = make_meta([1] * batch, context, slots, "cuda")
        x, weight, q, k, v = inputs[:5]
        eager = (ops.conv(x, weight, eager_pool, eager_meta),
                 ops.delta_rule(q, k, v, gates_of(inputs), eager_pool, eager_meta))
        torch.testing.assert_close(static_out[0], eager[0], rtol=0, atol=0)
        torch.testing.assert_close(static_out[1], eager[1], rtol=0, atol=0)
        torch.testing.assert_close(pool.ssm, eager_pool.ssm, rtol=0, atol=0)
        torch.testing.assert_close(pool.conv, eager_pool.conv, rtol=0, atol=0)
        got, want = run_both(ops, eager_meta, inputs, copy_pool(ref_pool, dtype), ref_pool)
        check(static_out, want, pool, ref_pool, dtype, f"replay {round_}")


def static_form(meta: AttentionMetadata, num_tokens: int, num_chunk_seqs: int) -> AttentionMetadata:
    """``meta`` in a graphed mixed step's static form for the delta rule, padded
    past the step (tokens, recurrent entries, longer sequences), as
    ``step_graphs.MixedGraphs`` stages it."""
    plan = static_step_plan(meta.query_lens_list, meta.context_lens_list, meta.state_slots_list,
                            num_tokens=num_tokens, num_entries=len(meta.query_lens_list) + 3,
                            num_chunk_seqs=num_chunk_seqs, scratch_slot=NUM_SLOTS)
    return dataclasses.replace(meta, derived={}, deltanet_static=plan.to_step("cuda"))


SHORT = ([1, 37, 1, 64, 2, 1], [False, True, False, False, True, False])  # no chunked call


@pytest.mark.parametrize("case, chunk_seqs", [(MIXED, 8), (SHORT, 0)], ids=["mixed", "short-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_static_delta_rule_matches_reference(ops, dtype, case, chunk_seqs):
    """The delta rule of a static step (a graphed mixed step's): decode rows
    and chunks of at most RECURRENT_MAX tokens by the decode kernel's row
    map, the longer sequences gathered into the chunked kernel with empty
    ones after them, on the scratch slot (none: no chunked call), and
    padding rows past the step; then captured and replayed.
    Equal to the reference on the step's rows, zeros on padding rows, every
    slot but the scratch one as the reference leaves it."""
    gen = torch.Generator().manual_seed(99)
    num_k, num_v = 2, 4
    pool = random_pool(gen, 2 * num_k * DK + num_v * DV, num_v, dtype, "cuda")
    ref_pool = copy_pool(pool, torch.float32)
    meta = random_step(gen, *case, "cuda")
    real = sum(case[0])
    bucket = real + 20
    inputs = random_inputs(gen, bucket, num_k, num_v, dtype, "cuda")
    q, k, v = inputs[2:5]
    static = static_form(meta, bucket, num_chunk_seqs=chunk_seqs)

    def step():
        return ops.delta_rule(q, k, v, gates_of(inputs), pool, static)

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # compile and autotune outside the capture, on copies of the pool
        saved = copy_pool(pool)
        step()
        pool.ssm.copy_(saved.ssm)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    want = TorchDeltaNetOps().delta_rule(q[:real].float(), k[:real].float(), v[:real].float(),
                                         Gates(*(t[:real] if t.dim() == 2 else t for t in gates_of(inputs,
                                                                                              torch.float32))),
                                         ref_pool, dataclasses.replace(meta, derived={}))
    assert out.shape == v.shape and out.dtype == dtype
    assert rel_err(out[:real], want) < TOL[dtype], rel_err(out[:real], want)
    assert (out[real:] == 0).all()
    assert rel_err(pool.ssm[:NUM_SLOTS], ref_pool.ssm[:NUM_SLOTS]) < TOL[dtype]


@pytest.mark.parametrize("rows", ["3-rows", "most-rows"])
def test_conv_steps_fold_compiled(rows):
    """The convolution's fold of in_proj's expand compiled (the interpreter's
    test, ``test_deltanet_decode``): as ``expand_rows`` then the plain step,
    a row's result the same, bit for bit, beside other neighbours."""
    pytest.importorskip("mstar_actors.models.deltanet_triton")
    from .test_deltanet_decode import test_conv_step_folds_in_projs_expand_as_expand_rows_would as check

    for sizes, conv_shards in ([96, 96, 128, 128, 4, 4], 3), ([320, 300], 1):
        check(sizes, conv_shards, rows, device="cuda")
