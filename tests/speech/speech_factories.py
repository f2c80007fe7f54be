"""A tiny Orpheus (a random Llama over a small tokenizer with Orpheus's tokens),
a random SNAC of the real architecture, and the reference decode of codes.

The tiny Llama is random but steered: its residual branches are scaled down
and its ``lm_head`` rows are set so that, greedily, start-of-speech is followed
by ``NUM_FRAMES`` valid frames of codec tokens (each in its slot's range) and
then end-of-speech. A purely random model would write tokens in the wrong
slots, whose frames are dropped, and leave nothing to decode.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CODEBOOK_SIZE = 64  # Orpheus's SNAC has 4096; the same layout over fewer codes keeps the vocabulary small
NUM_FRAMES = 9
FRAME_TOKENS = 7
FIRST_CODE = 10


def orpheus_tokenizer(base_dir: Path):
    """The frontend kit's BPE tokenizer plus <|eot_id|> and <custom_token_0..> (the codes consecutive)."""
    from transformers import AutoTokenizer

    from tests.frontend.conftest import make_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(make_tokenizer_dir(base_dir)), local_files_only=True)
    customs = [f"<custom_token_{i}>" for i in range(FIRST_CODE + FRAME_TOKENS * CODEBOOK_SIZE)]
    tok.add_tokens(["<|eot_id|>", *customs], special_tokens=True)
    return tok


def ids(tok, *names: str) -> list[int]:
    return [tok.convert_tokens_to_ids(n) for n in names]


def orpheus_prompt(tok, voice: str, text: str) -> list[int]:
    """Orpheus's prompt, written out here as its reference server writes it."""
    soh, eot, eoh, soa, sos = ids(tok, "<custom_token_3>", "<|eot_id|>", "<custom_token_4>", "<custom_token_5>",
                                  "<custom_token_1>")
    return [soh, *tok(f"{voice}: {text}").input_ids, eot, eoh, soa, sos]


def save_tiny_orpheus(folder: Path, tok, seed: int = 0):
    """The steered tiny Llama (see the module docstring) and its tokenizer in ``folder``; returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    eos, sos, eos_speech = ids(tok, "<|im_end|>", "<custom_token_1>", "<custom_token_2>")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=eos, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    base = tok.convert_tokens_to_ids(f"<custom_token_{FIRST_CODE}>")
    # distinct codes per slot: each token of the path has one successor
    codes = torch.stack([torch.randperm(CODEBOOK_SIZE)[:NUM_FRAMES] for _ in range(FRAME_TOKENS)], 1).flatten()
    path = [sos] + [base + (i % FRAME_TOKENS) * CODEBOOK_SIZE + int(c) for i, c in enumerate(codes)] + [eos_speech]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.mul_(0.02)
        for prev, nxt in zip(path, path[1:]):
            head[nxt] += 0.5 * emb[prev] / emb[prev].norm()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def save_tiny_snac(folder: Path, seed: int = 0):
    """A random SNAC with the 24 kHz model's layout (rates, strides, noise), narrower; returns it."""
    from snac import SNAC

    config = dict(sampling_rate=24000, encoder_dim=8, encoder_rates=[2, 4, 8, 8], decoder_dim=32,
                  decoder_rates=[8, 8, 4, 2], attn_window_size=None, codebook_size=CODEBOOK_SIZE, codebook_dim=8,
                  vq_strides=[4, 2, 1], noise=True, depthwise=True)
    torch.manual_seed(seed)
    model = SNAC(**config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return model


def frames_of(token_ids: list[int], code_base: int) -> list[list[int]]:
    """Orpheus's frames: codec tokens 7 at a time, each code ``id - base - slot * K``."""
    codes = [t - code_base for t in token_ids if code_base <= t < code_base + FRAME_TOKENS * CODEBOOK_SIZE]
    codes = [c - (i % FRAME_TOKENS) * CODEBOOK_SIZE for i, c in enumerate(codes)]
    frames = [codes[i:i + FRAME_TOKENS] for i in range(0, len(codes) - FRAME_TOKENS + 1, FRAME_TOKENS)]
    return [f for f in frames if all(0 <= c < CODEBOOK_SIZE for c in f)]


def snac_decode(snac, frames: list[list[int]]) -> torch.Tensor:
    """SNAC's decode of frames, its noise drawn under seed 0."""
    rows = [[f[0] for f in frames], [c for f in frames for c in (f[1], f[4])],
            [c for f in frames for c in (f[2], f[3], f[5], f[6])]]
    with torch.inference_mode():
        torch.manual_seed(0)
        return snac.decode([torch.tensor([r]) for r in rows])[0, 0]


def reference_pcm(snac, token_ids: list[int], code_base: int) -> bytes:
    """The served audio, computed directly: windows of 4 frames; frame m from
    window [m-1, m+2], frames 0 and the last two from the first and last."""
    frames = frames_of(token_ids, code_base)
    n, step = len(frames), 2048
    if n == 0:
        return b""
    if n < 4:
        audio = snac_decode(snac, frames)
    else:
        pieces = [snac_decode(snac, frames[0:4])[:step]]
        pieces += [snac_decode(snac, frames[m - 1:m + 3])[step:2 * step] for m in range(1, n - 2)]
        pieces.append(snac_decode(snac, frames[n - 4:n])[2 * step:])
        audio = torch.cat(pieces)
    return (audio.clamp(-1, 1) * 32767).numpy().astype("<i2").tobytes()
