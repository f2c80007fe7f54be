"""Qwen2.5-VL folders and an arena stand-in, for the preparation and serving
tests (and the VL benchmarks, which build the same folders).

``save_vl_prepare_folder`` writes what preparation reads (no weights);
``save_tiny_vl_model`` a servable tiny random model. ``HeapArena`` stands in
for the arena's producer end in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.word_tokenizer import save_word_tokenizer

IMAGE_TOKEN, VIDEO_TOKEN = 5, 6
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>",
            "<|vision_start|>", "<|vision_end|>"]
WORDS = ["user", "assistant", "system", "describe", "this", "image", "video", "and"] + [f"w{i}" for i in range(200)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }} "
    "{% elif c['type'] == 'image' %}<|vision_start|> <|image_pad|> <|vision_end|> "
    "{% elif c['type'] == 'video' %}<|vision_start|> <|video_pad|> <|vision_end|> {% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant{% endif %}"
)


def save_vl_prepare_folder(folder: Path, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280) -> Path:
    """What preparation reads from a Qwen2.5-VL folder: config.json, the
    tokenizer (with a chat template that writes Qwen's vision placeholders) and
    preprocessor_config.json. Returns ``folder``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    assert vocab["<|image_pad|>"] == IMAGE_TOKEN and vocab["<|video_pad|>"] == VIDEO_TOKEN
    save_word_tokenizer(folder, vocab, SPECIALS[3:], CHAT_TEMPLATE)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(folder)
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "vocab_size": 512, "image_token_id": IMAGE_TOKEN, "video_token_id": VIDEO_TOKEN,
              "bos_token_id": 1, "eos_token_id": 2,
              "text_config": {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def vl_prepare_info(folder: Path):
    """The launcher's facts for a ``save_vl_prepare_folder`` folder, stated here:
    it holds no decoder for ``load_model_info`` to read, and preparation needs none."""
    from mstar_actors.model_info import ModelInfo

    return ModelInfo(served_name="vl", model_dir=str(folder), architecture="Qwen2_5_VLForConditionalGeneration",
                     vocab_size=512, eos_token_ids=(2,), dtype="float32", max_model_len=1 << 20, is_multimodal=True,
                     media_token_ids={"image": IMAGE_TOKEN, "video": VIDEO_TOKEN})


def save_tiny_vl_model(folder: Path, max_pixels: int | None = None, *, real_patches: bool = False,
                       max_model_len: int = 512) -> Path:
    """A servable tiny random Qwen2.5-VL (float32 weights from the tests'
    ``vl_factories``), a tokenizer whose vision tokens are the model's ids and
    covering its whole vocabulary, and an image processor. Returns ``folder``.

    Default (the tests): 2 px patches, 2x2 merge, frames resized to at most
    ``max_pixels`` (32x32) so media fit the 512-token context. With
    ``real_patches`` the processor is Qwen2.5-VL's own (14 px patches, 2x2
    merge, 56x56 to ``max_pixels`` 28*28*1280 pixels), so media are resized
    and patched as for a real model, and the context is ``max_model_len``;
    the vision tower (hidden 32, depth 2) and text stack (hidden 64, 2 layers)
    stay tiny, so the model's share of a request is small next to preparing it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.models import vl_factories as vf

    if real_patches:
        _save_random_vl(folder, _real_patch_config(vf.make_vl_config(), max_model_len))
        processor = Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=56 * 56,
                                             max_pixels=max_pixels or 28 * 28 * 1280)
    else:
        vf.make_hf_vl_model(folder)
        processor = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=vf.MERGE, min_pixels=8 * 8,
                                             max_pixels=max_pixels or 32 * 32)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4, "<|image_pad|>": vf.IMAGE_TOKEN,
             "<|video_pad|>": vf.VIDEO_TOKEN, "<|vision_start|>": vf.VISION_START, "<|vision_end|>": vf.VISION_END}
    words = iter(WORDS + [f"x{i}" for i in range(vf.VOCAB)])
    taken = set(vocab.values())
    vocab |= {next(words): i for i in range(vf.VOCAB) if i not in taken}
    save_word_tokenizer(folder, vocab, SPECIALS[3:], CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return folder


def _real_patch_config(config, max_model_len: int):
    """The tests' tiny config with Qwen2.5-VL's patch geometry (14 px patches,
    2 frames per temporal patch, 2x2 merge, 112 px attention windows) and a
    context of ``max_model_len``; vision depth 2 (one windowed, one full block)."""
    vision = config.vision_config
    vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size = 14, 2, 2
    vision.window_size = 112  # 4x4 merged cells per window, as in the released models
    vision.depth, vision.fullatt_block_indexes = 2, [1]
    config.text_config.max_position_embeddings = max_model_len
    return config


def _save_random_vl(folder: Path, config, seed: int = 0) -> None:
    """``vl_factories.make_hf_vl_model`` for a given config: float32 random
    weights, spread wide, the vision tower's kept moderate."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.models.factories import _spread_weights

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    _spread_weights(model)
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                p.normal_(0.0, 0.1 if "patch_embed" not in name else 0.03)  # patch_embed sums 1,176 inputs
    model.save_pretrained(folder)


class HeapArena:
    """Stands in for the arena's producer end: copies each tensor into one
    buffer allocated (and touched) once, as the real arena copies into its
    shared segment (a fresh allocation per request would pay page faults the
    server never pays). The buffer is a ring: once it wraps, the oldest
    entries of ``tensors`` are overwritten (their shapes stay); a tensor
    bigger than the buffer replaces it with one twice its size."""

    def __init__(self, capacity_bytes: int = 64 << 20):
        import torch

        self.buffer = torch.empty(capacity_bytes, dtype=torch.uint8).zero_()
        self.tensors: dict[int, object] = {}
        self._offset = 0

    async def put_all(self, tensors, num_readers: int = 1):
        return [await self.put(tensor, num_readers) for tensor in tensors]

    async def put(self, tensor, num_readers: int = 1):
        import torch

        from mstar_actors.messages import TensorRef

        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        if nbytes > self.buffer.numel():  # a bigger clip: grow once (during the warm-up), touched as at start
            self.buffer = torch.empty(2 * nbytes, dtype=torch.uint8).zero_()
            self._offset = 0
        if self._offset + nbytes > self.buffer.numel():
            self._offset = 0
        block = self.buffer[self._offset:self._offset + nbytes]
        block.copy_(flat)
        self._offset += -(-nbytes // 64) * 64
        key = len(self.tensors)
        self.tensors[key] = block.view(tensor.dtype).reshape(tensor.shape)
        return TensorRef(segment="heap", offset=key, nbytes=nbytes,
                         dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape))
