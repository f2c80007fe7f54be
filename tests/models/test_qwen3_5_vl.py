"""Qwen3.5 (text and vision) through the runner against transformers'
``generate`` on a tiny random model: greedy tokens for an image prompt and a
video prompt the preparer made, chunked prefill splitting a placeholder run,
and a text prompt beside them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar_actors import messages
from mstar_actors.models import qwen3_5_vl
from mstar_actors.prepare.preparers import video_pixel_constants
from plan_driver import PlanDriver
from runner_factories import make_runner

from .hybrid_factories import interpreted_cuda_ops
from .qwen3_5_factories import make_hf_qwen3_5
from .test_qwen3_5_vision import chat_request, mp4_url, png_url, video_frames

BLOCK_SIZE = 4
NUM_NEW = 8
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_5_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_vl")
    hf, processor = make_hf_qwen3_5(folder)
    return folder, hf, processor


class Arena:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def store(self, tensor: torch.Tensor) -> messages.TensorRef:
        name = str(len(self.tensors))
        self.tensors[name] = tensor
        return messages.TensorRef(name, 0, tensor.numel() * tensor.element_size(), str(tensor.dtype)[6:], tuple(tensor.shape))

    def resolve(self, ref: messages.TensorRef) -> torch.Tensor:
        return self.tensors[ref.segment]


def reference(hf, preparer, draft) -> list[int]:
    """transformers' greedy tokens on the preparer's ids and rows."""
    ids = torch.tensor([draft.prepared.prompt_token_ids])
    kwargs = {"mm_token_type_ids": (ids == hf.config.image_token_id).long() + 2 * (ids == hf.config.video_token_id).long()}
    images = [m for m in draft.media if m.kind == "image"]
    frames = [m for m in draft.media if m.kind == "video"]
    if images:
        kwargs |= dict(pixel_values=torch.cat([m.pixel_values for m in images]),
                       image_grid_thw=torch.tensor([m.grid_thw for m in images]))
    if frames:
        from mstar_actors.models.vision import PixelNorm

        rows = torch.cat([m.pixel_values for m in frames])
        norm = PixelNorm(*video_pixel_constants(preparer.video_processor), rows.shape[1] // 3)
        _, h, w = frames[0].grid_thw
        kwargs |= dict(pixel_values_videos=norm(rows), video_grid_thw=torch.tensor([[len(frames), h, w]]))
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("cuda_kernels", [
    False,
    # The layers' CUDA-only kernels (the fused attention with its three-axis rotary positions, the gated
    # norm) on CPU tensors in Triton's interpreter.
    pytest.param(True, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter")),
], ids=["torch", "cuda-kernels-interpreted"])
def test_runner_matches_generate_for_image_video_and_text(qwen3_5_model, cuda_kernels, monkeypatch):
    ran = interpreted_cuda_ops(monkeypatch) if cuda_kernels else None
    from mstar_actors.model_info import load_model_info
    from mstar_actors.prepare.media import MediaLimits
    from mstar_actors.prepare.preparers import load_preparer, with_media
    from runner_factories import runner_config

    folder, hf, _ = qwen3_5_model
    preparer = load_preparer(load_model_info(runner_config(folder)), MediaLimits(video_fps=2.0))
    image = np.random.default_rng(4).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    drafts = {
        "img": preparer.draft(chat_request(("image", png_url(image))), {}),
        "vid": preparer.draft(chat_request(("video", mp4_url(video_frames(10, 64, 96, seed=6), fps=4))), {}),
    }
    arena = Arena()
    # What the prepare actor sends: each draft item's rows stored, the message given their refs.
    prompts = {rid: (d.prepared.prompt_token_ids, with_media(d, [arena.store(m.pixel_values) for m in d.media]).media)
               for rid, d in drafts.items()}
    prompts["txt"] = (drafts["img"].prepared.prompt_token_ids[:5] + [7, 8, 9] * 5, [])
    runner = make_runner(folder, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=256,
                         resolve_tensor=arena.resolve)
    assert isinstance(runner.model, qwen3_5_vl.Qwen3_5ForConditionalGeneration)
    d = PlanDriver(runner, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)
    starts = [d.start(rid, p, m) for rid, (p, m) in prompts.items()]  # each on a state slot of its own
    img_item = prompts["img"][1][0]
    # img's first chunk ends inside its image run; vid's inside its second frame's.
    d.step(starts, [d.chunk("img", img_item.token_offset + 3), d.chunk("vid", prompts["vid"][1][1].token_offset + 2),
                    d.chunk("txt", 6)])
    d.step([], [d.chunk("img"), d.chunk("vid"), d.chunk("txt")])
    outputs = d.run_to_end()
    assert outputs["img"] == reference(hf, preparer, drafts["img"])
    assert outputs["vid"] == reference(hf, preparer, drafts["vid"])
    ids = torch.tensor([prompts["txt"][0]])
    with torch.no_grad():
        text = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False)
    assert outputs["txt"] == text[0, ids.shape[1]:].tolist()
    assert ran is None or (ran and all(ran))  # interpreted: the fused attention ran every time
