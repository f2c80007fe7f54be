"""A tiny random Qwen3.5 (text and vision) saved to a folder with a processor:
a byte-level BPE tokenizer that knows Qwen's vision specials and the video
timestamps, Qwen2-VL's image processor and Qwen3-VL's video processor with
Qwen3.5's 16 px patches."""

from __future__ import annotations

from pathlib import Path

import torch

from .factories import TINY_DECODER, TINY_TOWER, _spread_weights

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
VOCAB = 400
MERGE = TINY_TOWER["spatial_merge_size"]
PATCH = 16
NUM_POSITION_EMBEDDINGS = 36  # a 6 x 6 table: every test grid resamples it
MIN_PIXELS, MAX_PIXELS = 32 * 32, 32 * 32 * 16  # at most 16 merged tokens per frame
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen3.5's own template writes the same vision placeholders."""


def make_qwen3_5_config(token_ids: dict[str, int]):
    from transformers import Qwen3_5Config

    text = dict(
        TINY_DECODER,
        layer_types=["linear_attention", "full_attention"],
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        eos_token_id=token_ids["<|im_end|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )
    vision = dict(
        TINY_TOWER,
        depth=2,
        patch_size=PATCH,
        num_position_embeddings=NUM_POSITION_EMBEDDINGS,
    )
    return Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def save_tokenizer(folder: Path):
    """A byte-level BPE over ``VOCAB`` ids, trained on chat-like text and the
    processor's ``<t seconds>`` stamps, with Qwen's specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["describe this image and this video", "user assistant system", "what is in the picture"]
    corpus += [f"<{t / 10:.1f} seconds>" for t in range(0, 200, 5)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def save_processors(folder: Path):
    """Qwen3.5's processor pieces with tiny pixel budgets; returns the processor."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = save_tokenizer(folder)
    image = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE,
                                     min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    video = Qwen3VLVideoProcessor(patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE, fps=2,
                                  size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS * 4},
                                  cap_pixels_per_frame=False)
    class Processor(Qwen3VLProcessor):
        """The real processor; without torchvision its class check can't look
        video processors up (the video processor itself still runs)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument_name == "video_processor" else super().check_argument_for_proper_class(argument_name, argument)

    processor = Processor(image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=CHAT_TEMPLATE)
    image.save_pretrained(folder)
    video.save_pretrained(folder)
    return processor


def make_hf_qwen3_5(folder: Path, seed: int = 0):
    """Save a random float32 Qwen3.5 and its processor to ``folder``; return
    (model in eval mode, processor)."""
    from transformers import Qwen3_5ForConditionalGeneration

    processor = save_processors(folder)
    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(make_qwen3_5_config(ids)).to(torch.float32).eval()
    _spread_weights(model)
    with torch.no_grad():  # keep the vision tower's activations moderate
        for name, p in model.model.visual.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2) if name.endswith("weight") else p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.1 if "patch_embed" not in name else 0.02)
    model.save_pretrained(folder)
    return model, processor


def random_pixels(num_patches: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_patches, 3 * 2 * PATCH * PATCH, generator=gen)
