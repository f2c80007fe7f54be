"""Paged decode attention: the graph-safe torch path and the Triton kernel.

On CPU the Triton kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET), so shapes stay tiny; the ``gpu`` tests run it compiled.
"""

from __future__ import annotations

import math

import pytest
import torch

from mstar_actors.models.attention import AttentionMetadata, TorchPagedAttention

BLOCK_SIZE = 16


def make_paged_case(context_lens: list[int], *, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
                    block_size: int = BLOCK_SIZE, max_blocks: int | None = None, num_blocks: int | None = None,
                    dtype=torch.float32, device="cpu", seed: int = 0):
    """Random q, a random KV cache and block tables of non-contiguous blocks.

    Each sequence owns ``cdiv(ctx, block_size)`` distinct, shuffled blocks; the
    rest of its row (up to ``max_blocks``) is padded with a valid block id of
    another sequence, so a kernel that reads past the context reads real data.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in context_lens]
    max_blocks = max_blocks or max(need)
    num_blocks = num_blocks or sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, taken = [], 0
    for n in need:
        row = order[taken : taken + n]
        taken += n
        tables.append(row + [order[-1]] * (max_blocks - n))
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return dict(
        q=q.to(device=device, dtype=dtype),
        kv_cache=kv.to(device=device, dtype=dtype),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def reference_decode(q, kv_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """Explicit fp32 softmax attention, one sequence at a time."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    group = q.shape[1] // num_kv_heads
    out = []
    for i, ctx in enumerate(context_lens.tolist()):
        blocks = block_tables[i, : math.ceil(ctx / block_size)].long()
        kv = kv_cache[:, blocks].flatten(1, 2)[:, :ctx].float()  # [2, ctx, KH, D]
        k = kv[0].repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = kv[1].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def decode_meta(case: dict, *, graph_decode: bool) -> AttentionMetadata:
    """Metadata for one decode row per sequence (the new token already cached)."""
    lens = case["context_lens"].tolist()
    block_size = case["kv_cache"].shape[2]
    tables = case["block_tables"]
    slots = [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=tables.device),
        block_tables=tables,
        query_start=torch.arange(len(lens) + 1, dtype=torch.int32, device=tables.device),
        context_lens=case["context_lens"],
        query_lens_list=[1] * len(lens),
        context_lens_list=lens,
        num_blocks_list=[math.ceil(n / block_size) for n in lens],
        graph_decode=graph_decode,
    )


# --- graph_decode in the torch reference ----------------------------------------------------


def test_torch_graph_decode_matches_normal_decode_and_reference():
    case = make_paged_case([1, 17, 40], max_blocks=6)
    backend = TorchPagedAttention()
    normal = backend.attend(case["q"], case["kv_cache"], decode_meta(case, graph_decode=False), case["scale"])
    graph = backend.attend(case["q"], case["kv_cache"], decode_meta(case, graph_decode=True), case["scale"])
    torch.testing.assert_close(graph, normal, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graph, reference_decode(**case), atol=1e-5, rtol=1e-5)


def test_torch_graph_decode_ignores_stale_lists():
    """Inside a replayed graph the lists describe the captured step, not this one."""
    case = make_paged_case([5, 33], max_blocks=4)
    meta = decode_meta(case, graph_decode=True)
    meta.context_lens_list, meta.num_blocks_list, meta.derived = [1, 1], [1, 1], {"decode": None}
    out = TorchPagedAttention().attend(case["q"], case["kv_cache"], meta, case["scale"])
    torch.testing.assert_close(out, reference_decode(**case), atol=1e-5, rtol=1e-5)


def test_torch_graph_decode_padded_rows_are_finite():
    """Padded rows (context 1 on a scratch block, or a stray 0) never give NaN."""
    case = make_paged_case([1, 1, 9], max_blocks=3)
    case["block_tables"][:2] = case["block_tables"][2, 0]  # padded rows share one scratch block
    case["context_lens"][1] = 0
    out = TorchPagedAttention().attend(case["q"], case["kv_cache"], decode_meta(case, graph_decode=True), case["scale"])
    assert torch.isfinite(out).all()


def test_torch_graph_decode_write_kv_lands_in_slots():
    case = make_paged_case([3, 20], max_blocks=2)
    meta = decode_meta(case, graph_decode=True)
    k = torch.randn(2, 2, 64)
    v = torch.randn(2, 2, 64)
    TorchPagedAttention().write_kv(case["kv_cache"], k, v, meta)
    flat = case["kv_cache"].view(2, -1, 2, 64)
    torch.testing.assert_close(flat[0, meta.slot_mapping], k)
    torch.testing.assert_close(flat[1, meta.slot_mapping], v)


# --- the Triton kernel (Triton's interpreter on CPU) ----------------------------------------

triton_attention = pytest.importorskip("mstar_actors.models.triton_attention")
paged_decode_attention = triton_attention.paged_decode_attention
TritonPagedAttention = triton_attention.TritonPagedAttention


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_matches_fp32_reference(num_splits):
    case = make_paged_case([1, 17, 40], max_blocks=6)  # padded table entries point at a real block
    out = paged_decode_attention(**case, num_splits=num_splits)
    torch.testing.assert_close(out, reference_decode(**case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads", [(4, 4, 4), (12, 8, 1)])
def test_kernel_other_pages_and_groups(block_size, num_heads, num_kv_heads):
    """Pages smaller or not a power of two, no GQA and one KV head for all."""
    case = make_paged_case([3, 70], block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=32, seed=1)
    out = paged_decode_attention(**case, num_splits=2)
    torch.testing.assert_close(out, reference_decode(**case), atol=1e-5, rtol=1e-5)


def test_kernel_writes_into_out_and_keeps_padded_rows_finite():
    case = make_paged_case([1, 1, 9], max_blocks=3)
    case["block_tables"][:2] = case["block_tables"][2, 0]  # padded rows share one scratch block
    case["context_lens"][1] = 0  # a stray empty row reads as length 1
    out = torch.full_like(case["q"], float("nan"))
    assert paged_decode_attention(**case, out=out, num_splits=2) is out
    assert torch.isfinite(out).all()
    case["context_lens"][1] = 1
    torch.testing.assert_close(out, reference_decode(**case), atol=1e-5, rtol=1e-5)


def test_kernel_fp16():
    case = make_paged_case([5, 33], dtype=torch.float16)
    out = paged_decode_attention(**case)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference_decode(**case), atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_dim=80), "head_dim 80 is not supported; accepted: a power of two"),
        (dict(num_heads=3, num_kv_heads=2), "multiple of the KV heads"),
    ],
)
def test_kernel_refuses_shapes(change, message):
    case = make_paged_case([4], **change)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**case)


def test_kernel_refuses_dtypes():
    case = make_paged_case([4])
    with pytest.raises(ValueError, match="block_tables .* must be int32"):
        paged_decode_attention(**(case | dict(block_tables=case["block_tables"].long())))
    with pytest.raises(ValueError, match="kv_cache torch.float16; both must be one of"):
        paged_decode_attention(**(case | dict(kv_cache=case["kv_cache"].half())))


def mixed_step(block_size: int = BLOCK_SIZE, seed: int = 2):
    """A mixed step: a prefill chunk on a cached prefix between two decode rows."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 12
    kv = torch.randn(2, num_blocks, block_size, 2, 64, generator=gen)
    tables = torch.tensor([[3, 0, 0], [7, 1, 9], [5, 10, 0]], dtype=torch.int32)
    query_lens, context_lens = [1, 5, 1], [9, 37, 20]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(7, dtype=torch.long),  # not read by attend
        block_tables=tables,
        query_start=torch.tensor([0, 1, 6, 7], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_lens_list=query_lens,
        context_lens_list=context_lens,
        num_blocks_list=[1, 3, 2],
    )
    return torch.randn(7, 4, 64, generator=gen), kv, meta


def test_backend_mixed_step_matches_reference():
    q, kv, meta = mixed_step()
    expected = TorchPagedAttention().attend(q, kv, meta, 0.125)
    meta.derived.clear()
    torch.testing.assert_close(TritonPagedAttention().attend(q, kv, meta, 0.125), expected, atol=1e-5, rtol=1e-5)


def test_backend_graph_decode_matches_reference():
    case = make_paged_case([1, 17, 40], max_blocks=6)
    meta = decode_meta(case, graph_decode=True)
    meta.context_lens_list = [1, 1, 1]  # stale lists are not read
    out = TritonPagedAttention().attend(case["q"], case["kv_cache"], meta, case["scale"])
    torch.testing.assert_close(out, reference_decode(**case), atol=1e-5, rtol=1e-5)


def test_backend_falls_back_for_head_dims_without_kernel():
    case = make_paged_case([6, 19], head_dim=80)
    meta = decode_meta(case, graph_decode=False)
    out = TritonPagedAttention().attend(case["q"], case["kv_cache"], meta, case["scale"])
    torch.testing.assert_close(out, reference_decode(**case), atol=1e-5, rtol=1e-5)


def test_attention_backend_picks_by_device():
    from mstar_actors.models.cpu_attention import CpuPagedAttention
    from mstar_actors.models.loader import attention_backend

    assert type(attention_backend("cpu")) is CpuPagedAttention
    assert isinstance(attention_backend(torch.device("cuda", 0)), TritonPagedAttention)


# --- on the GPU -----------------------------------------------------------------------------


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected).norm() / expected.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("context_lens", [[2000], [1, 17, 40], list(range(1, 2001, 32))[:64]], ids=["b1-2000", "b3", "b64"])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_kernel_bf16_on_cuda(context_lens, num_splits):
    case = make_paged_case(context_lens, num_heads=32, num_kv_heads=8, dtype=torch.bfloat16, device="cuda",
                           max_blocks=2048 // BLOCK_SIZE)
    expected = reference_decode(**case)
    out = paged_decode_attention(**case, num_splits=num_splits)
    assert relative_error(out, expected) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_fp32_on_cuda(head_dim):
    case = make_paged_case([1, 17, 40, 300], head_dim=head_dim, device="cuda", max_blocks=32)
    torch.testing.assert_close(paged_decode_attention(**case), reference_decode(**case), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_kernel_replays_in_a_cuda_graph(batch):
    """Captured once, replayed with new queries, tables and lengths in the same tensors."""
    gen = torch.Generator().manual_seed(batch)
    lens_a = torch.randint(1, 600, (batch,), generator=gen).tolist()
    lens_b = torch.randint(1, 600, (batch,), generator=gen).tolist()
    shape = dict(num_heads=32, num_kv_heads=8, dtype=torch.bfloat16, device="cuda", max_blocks=40,
                 num_blocks=40 * batch + 3)
    static = make_paged_case(lens_a, **shape)
    args = {k: static[k] for k in ("q", "kv_cache", "block_tables", "context_lens")}
    out = torch.empty_like(static["q"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        paged_decode_attention(**args, scale=static["scale"], out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(**args, scale=static["scale"], out=out)
    for lens, seed in ((lens_b, 1), (lens_a, 2)):
        fresh = make_paged_case(lens, **shape, seed=seed)
        for key, tensor in args.items():
            tensor.copy_(fresh[key])
        out.zero_()
        graph.replay()
        assert relative_error(out, reference_decode(**fresh)) < 1e-2


@pytest.mark.gpu
def test_backend_graph_decode_replays_in_a_cuda_graph():
    case = make_paged_case([5, 100, 33, 1], num_heads=32, num_kv_heads=8, dtype=torch.bfloat16, device="cuda",
                           max_blocks=8)
    meta = decode_meta(case, graph_decode=True)
    backend = TritonPagedAttention()
    k = torch.randn(4, 8, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def step():
        backend.write_kv(case["kv_cache"], k, v, meta)
        return backend.attend(case["q"], case["kv_cache"], meta, case["scale"])

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    case["context_lens"].copy_(torch.tensor([6, 101, 34, 2], dtype=torch.int32))
    meta.slot_mapping.add_(1)  # the next token of each sequence
    k.normal_()
    v.normal_()
    graph.replay()
    assert relative_error(out, reference_decode(**case)) < 1e-2


@pytest.mark.gpu
def test_runner_on_cuda_uses_triton_and_matches_generate(hf_models):
    from .test_runner import make_runner, reference, run_script

    folder, hf = hf_models("llama")
    runner = make_runner(folder, device="cuda")
    assert isinstance(runner.model.model.layers[0].self_attn.backend, TritonPagedAttention)
    outputs, prompts = run_script(runner)
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference(hf, prompt), f"sequence {rid} diverged"


def test_runner_with_triton_backend_matches_generate_in_interpreter(hf_models):
    """Mixed steps through the runner (a chunked prefill beside decodes) with
    decode rows on the kernel, in Triton's interpreter on CPU: 8 greedy tokens
    as transformers makes them."""
    from plan_driver import PlanDriver

    from mstar_actors import messages

    from .test_runner import make_runner

    num_new = 8
    folder, hf = hf_models("llama")
    runner = make_runner(folder)
    backend = TritonPagedAttention()
    for layer in runner.model.model.layers:
        layer.self_attn.backend = backend
    greedy = messages.SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    d = PlanDriver(runner, block_size=runner.block_size, num_new=num_new, sampling=greedy)
    gen = torch.Generator().manual_seed(3)
    prompts = {"a": torch.randint(3, 500, (6,), generator=gen).tolist(),
               "b": torch.randint(3, 500, (21,), generator=gen).tolist()}
    d.step([d.start("a", prompts["a"])], [d.chunk("a")])
    d.step([d.start("b", prompts["b"])], [d.chunk("b", 11), *d.decodes("a")])
    d.step([], [d.chunk("b"), *d.decodes("a")])
    outputs = d.run_to_end()
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    for rid, prompt in prompts.items():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False)[0, len(prompt):]
        assert outputs[rid] == expected.tolist(), f"sequence {rid} diverged"
