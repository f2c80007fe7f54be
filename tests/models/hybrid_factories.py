"""A tiny random Qwen3.5 text model (hybrid Gated DeltaNet + gated attention), saved to a folder."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

VOCAB = 256
EOS = 1


def qwen3_5_config(**overrides) -> Qwen3_5TextConfig:
    """Two DeltaNet layers, one gated-attention layer, then a DeltaNet layer; grouped
    value heads (2 key heads, 4 value heads) as the released models have."""
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        eos_token_id=EOS, bos_token_id=EOS, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )  # fmt: skip
    return Qwen3_5TextConfig(**(fields | overrides))


def spread(model) -> None:
    """Weights wider than the init (norms off their zero centre too), so greedy
    argmaxes are far from ties; the DeltaNet's decay parameters keep theirs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name or "dt_bias" in name:
                continue
            if "lora_" in name:
                p.normal_(0.0, 0.25)  # PEFT starts B at zero; a zero adapter would prove nothing
            elif "norm" in name:
                p.normal_(0.0, 0.3)
            elif "base_layer" not in name:
                p.normal_(0.0, 1.0 if "embed" in name else 0.15)


def make_qwen3_5(folder: Path, seed: int = 0, **overrides) -> Qwen3_5ForCausalLM:
    """Save a random float32 Qwen3.5 text model to ``folder``; return it (eval mode)."""
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(qwen3_5_config(**overrides)).eval()
    spread(model)
    model.save_pretrained(folder)
    return model


def generate(model, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy continuation, EOS ignored."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=num_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def interpreted_cuda_ops(monkeypatch) -> list[bool]:
    """Qwen3.5's CUDA-only kernels (``qwen3_5.cuda_fused_ops``) on CPU tensors,
    in Triton's interpreter; the list it returns gets, for each call of the
    fused attention's ``norm_rope_write_kv``, whether it ran (not None: no
    silent fall back to the torch ops)."""
    from mstar_actors.models import qwen3_5, triton_fused

    ran: list[bool] = []

    class Ops:
        def __getattr__(self, name):
            return getattr(triton_fused, name)

        def norm_rope_write_kv(self, *args, **kwargs):
            out = triton_fused.norm_rope_write_kv(*args, **kwargs)
            ran.append(out is not None)
            return out

    monkeypatch.setattr(qwen3_5, "cuda_fused_ops", lambda x: Ops())
    return ran
