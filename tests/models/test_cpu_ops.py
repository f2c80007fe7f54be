"""The fused CPU layer ops (``cpu_ops``) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar_actors.models import cpu_ops
from mstar_actors.models.attention import allocate_kv_cache
from mstar_actors.models.decoder import RMSNorm
from mstar_actors.models.rope import rotate

from .test_cpu_fast_paths import make_model, prefill_meta

needs_kernel = pytest.mark.skipif(cpu_ops.kernel() is None, reason="no AVX-512 or AVX2, or no C compiler here")


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (3, 4, 64), (5, 45)])
def test_rms_norm_matches_torch_and_adds_the_residual_in_place(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x, y, w = torch.randn(shape, generator=gen) * 5, torch.randn(shape, generator=gen), torch.rand(shape[-1], generator=gen)
    want_sum = x + y
    with torch.no_grad():
        torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5), rtol=1e-5, atol=1e-6)
        norm = RMSNorm(shape[-1], 1e-5)
        norm.weight.copy_(w)
        normed, total = norm.add_norm(x, y)
    assert total is y and torch.equal(y, want_sum)  # the same single addition, into y
    torch.testing.assert_close(normed, F.rms_norm(want_sum, (shape[-1],), w, 1e-5), rtol=1e-5, atol=1e-6)


@needs_kernel
def test_rms_norm_declines_rows_it_cannot_take():
    w = torch.ones(8)
    assert cpu_ops.rms_norm(torch.randn(8, 4).t(), torch.ones(4 * 2)[:4], 1e-5) is None  # column-major rows
    assert cpu_ops.rms_norm(torch.randn(3, 8), w, 1e-5, torch.randn(8, 3).t()) is None


@needs_kernel
def test_rope_write_kv_equals_rotary_and_index_copy_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    num_tokens, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = (t.view(num_tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    angles = torch.randn(num_tokens, dim // 2, generator=gen)
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    ssin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None]
    slots = torch.tensor([17, 3, 40, 41, 0])
    want_cache = torch.zeros(2, 4, 16, kv_heads, dim)
    want_q, want_k = rotate(q, cos, ssin), rotate(k, cos, ssin)
    want_cache.view(2, -1, kv_heads, dim)[0].index_copy_(0, slots, want_k)
    want_cache.view(2, -1, kv_heads, dim)[1].index_copy_(0, slots, v)
    cache = torch.zeros_like(want_cache)
    assert cpu_ops.rope_write_kv(q, k, v, cos, ssin, cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(cache, want_cache)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 21), (2, 3, 2 * 16)])
def test_silu_mul_matches_torch(shape):
    gen = torch.Generator().manual_seed(shape[-1])
    gate_up = torch.randn(shape, generator=gen) * 12  # exponents well past either end of e^x's reduced range
    gate_up.view(-1)[:6] = torch.tensor([-100.0, -88.0, 0.0, 88.0, 100.0, 3e38])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_silu_mul_declines_rows_it_cannot_take():
    assert cpu_ops.silu_mul(torch.randn(3, 7)) is None  # no two halves
    assert cpu_ops.silu_mul(torch.randn(8, 4).t()) is None  # column-major rows


@needs_kernel
def test_model_forward_matches_the_torch_ops(monkeypatch):
    """The whole prefill forward on the fused ops against the same model on torch's."""
    model = make_model()
    ids = torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(3))

    def forward():
        spec = model.spec
        caches = allocate_kv_cache(spec.num_layers, 8, 16, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, torch.arange(len(ids)), caches, prefill_meta(len(ids))))
        return logits, caches

    fast, fast_caches = forward()
    monkeypatch.setattr(cpu_ops, "kernel", lambda: None)
    plain, plain_caches = forward()
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    for got, want in zip(fast_caches, plain_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
