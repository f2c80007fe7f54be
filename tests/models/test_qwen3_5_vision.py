"""Qwen3.5's vision tower and prompt positions against transformers on a tiny
random model: the tower's rows (images, videos, several items at once, the
position table resampled onto each grid), the multimodal rotary positions of
prompts the real processor wrote, and the preparer's token ids and pixel rows
against that processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar_actors import messages
from mstar_actors.models.checkpoint import CheckpointRules
from mstar_actors.models.qwen3_5_vision import (
    QWEN3_5_VISION_RULES,
    Qwen3_5VisionTransformer,
    mrope_positions,
    parse_qwen3_5_vision_spec,
)
from mstar_actors.models.spec import ModelLoadError

from .qwen3_5_factories import MERGE, make_hf_qwen3_5, random_pixels

IMAGE_GRID = (1, 4, 6)
VIDEO_GRID = (3, 8, 4)
WIDE_GRID = (1, 2, 14)  # wider than the 6 x 6 position table


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf, processor = make_hf_qwen3_5(folder)
    return folder, hf, processor


def load_tower(folder) -> Qwen3_5VisionTransformer:
    """Our tower with the checkpoint's ``model.visual.*`` tensors placed by the rules."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tower = Qwen3_5VisionTransformer(parse_qwen3_5_vision_spec(cfg, "config.json"))
    rules = CheckpointRules(QWEN3_5_VISION_RULES)
    state = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if name.startswith("model.visual."):
            ours, shard = rules.map_tensor(name)
            assert shard is None and ours.startswith("visual."), name
            state[ours.removeprefix("visual.")] = tensor
    tower.load_state_dict(state, strict=True)  # every tower tensor came from the checkpoint
    return tower.eval()


# -- the tower -------------------------------------------------------------------


@pytest.mark.parametrize("grids", [[IMAGE_GRID], [VIDEO_GRID], [IMAGE_GRID, VIDEO_GRID, WIDE_GRID]],
                         ids=["image", "video", "mixed"])
def test_tower_matches_transformers(qwen3_5, grids):
    folder, hf, _ = qwen3_5
    tower = load_tower(folder)
    items = [random_pixels(t * h * w, seed=i) for i, (t, h, w) in enumerate(grids)]
    with torch.no_grad():
        expected = hf.model.visual(torch.cat(items), grid_thw=torch.tensor(grids)).pooler_output
        per_item = tower(items, grids)
        whole = tower(torch.cat(items), grids)
    assert per_item.shape == (sum(t * h * w for t, h, w in grids) // MERGE**2, 64)
    torch.testing.assert_close(per_item, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=0)


def test_a_video_encodes_as_its_frames(qwen3_5):
    """The preparer sends a video as one (1, h, w) item per temporal patch:
    attention stays inside a frame, so the rows are the whole clip's."""
    folder, _, _ = qwen3_5
    tower = load_tower(folder)
    t, h, w = VIDEO_GRID
    pixels = random_pixels(t * h * w, seed=5)
    with torch.no_grad():
        whole = tower(pixels, [VIDEO_GRID])
        frames = tower(list(pixels.split(h * w)), [(1, h, w)] * t)
    torch.testing.assert_close(frames, whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("change, field", [
    ({"depth": None}, "vision_config.depth"),
    ({"num_position_embeddings": None}, "vision_config.num_position_embeddings"),
    ({"num_position_embeddings": 40}, "must be a square"),
    ({"hidden_act": "silu"}, "hidden_act 'silu' is not supported"),
])
def test_spec_names_the_bad_field(qwen3_5, change, field):
    import json

    folder, _, _ = qwen3_5
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            del cfg["vision_config"][key]
        else:
            cfg["vision_config"][key] = value
    with pytest.raises(ModelLoadError, match=field):
        parse_qwen3_5_vision_spec(cfg, "config.json")


# -- multimodal rotary positions -----------------------------------------------------


def processor_inputs(processor, frames=None, image=None, text_after="what is in the picture", fps=2.0):
    """The real processor's output for a chat with an image and/or a video
    (frames already sampled at ``fps`` and sized to the processor's grid)."""
    content = [{"type": "text", "text": "describe this image"}]
    if image is not None:
        content.append({"type": "image"})
    if frames is not None:
        content += [{"type": "text", "text": "and this video"}, {"type": "video"}]
    content.append({"type": "text", "text": text_after})
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    kwargs = {}
    if frames is not None:
        n = len(frames)
        kwargs = dict(videos=[frames], video_metadata=[{"fps": fps, "total_num_frames": n, "frames_indices": list(range(n))}],
                      videos_kwargs=dict(do_sample_frames=False, do_resize=False, do_convert_rgb=False))
    if image is not None:
        kwargs["images"] = [image]
    return processor(text=[text], return_tensors="pt", **kwargs)


def items_of(input_ids: list[int], out, image_id: int, video_id: int) -> list[messages.MediaItem]:
    """MediaItems from the processor's runs of placeholder tokens: one per
    image, one per temporal patch of a video."""
    grids = {image_id: [tuple(g) for g in out.get("image_grid_thw", torch.zeros(0, 3)).tolist()],
             video_id: [(1, h, w) for t, h, w in out.get("video_grid_thw", torch.zeros(0, 3)).tolist() for _ in range(t)]}
    items, i = [], 0
    while i < len(input_ids):
        tok = input_ids[i]
        if tok in grids:
            j = i
            while j < len(input_ids) and input_ids[j] == tok:
                j += 1
            ref = messages.TensorRef("x", 0, 0, "float32", ())
            items.append(messages.MediaItem("image" if tok == image_id else "video", ref, grids[tok].pop(0), i, j - i))
            i = j
        else:
            i += 1
    assert not any(grids.values())
    return items


def video_frames(num_frames: int, height: int = 64, width: int = 96, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (num_frames, height, width, 3), dtype=np.uint8)


@pytest.fixture()
def torchvision_normalize(monkeypatch):
    """The processors' one torchvision call on these inputs (``normalize``:
    subtract, divide, per channel), for the venv has no torchvision."""
    from transformers import image_processing_backends

    def normalize(x, mean, std, inplace=False):
        x = x if inplace else x.clone()
        mean = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        return x.sub_(mean).div_(std)

    monkeypatch.setattr(image_processing_backends, "tvF", type("tvF", (), {"normalize": staticmethod(normalize)}),
                        raising=False)


@pytest.mark.parametrize("num_frames", [5, 2], ids=["video-5-frames", "video-2-frames"])
def test_positions_match_get_rope_index(qwen3_5, torchvision_normalize, num_frames):
    from PIL import Image

    _, hf, processor = qwen3_5
    image = Image.fromarray(video_frames(1, 50, 70, seed=3)[0])
    out = processor_inputs(processor, frames=video_frames(num_frames), image=image)
    ids = out["input_ids"][0].tolist()
    items = items_of(ids, out, hf.config.image_token_id, hf.config.video_token_id)
    assert [m.kind for m in items] == ["image"] + ["video"] * ((num_frames + 1) // 2)
    ours, delta = mrope_positions(len(ids), items, MERGE)
    expected, expected_delta = hf.model.get_rope_index(out["input_ids"], out["mm_token_type_ids"],
                                                       out["image_grid_thw"], out["video_grid_thw"])
    assert torch.equal(ours, expected[:, 0]) and delta == expected_delta.item()


def test_positions_of_a_text_only_prompt_are_plain():
    positions, delta = mrope_positions(5, [], MERGE)
    assert positions.tolist() == [list(range(5))] * 3 and delta == 0


# -- preparation against the processor ------------------------------------------------------


def png_url(array: np.ndarray) -> str:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def mp4_url(frames: np.ndarray, fps: int) -> str:
    import base64
    import io

    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mjpeg", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuvj444p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def preparer(qwen3_5):
    from mstar_actors.model_info import ModelInfo
    from mstar_actors.prepare.media import MediaLimits
    from mstar_actors.prepare.preparers import load_preparer

    folder, hf, _ = qwen3_5
    info = ModelInfo(served_name="q", model_dir=str(folder), architecture="Qwen3_5ForConditionalGeneration",
                     vocab_size=hf.config.text_config.vocab_size, eos_token_ids=(2,), dtype="float32",
                     max_model_len=1 << 20, is_multimodal=True,
                     media_token_ids={"image": hf.config.image_token_id, "video": hf.config.video_token_id})
    return load_preparer(info, MediaLimits(video_fps=2.0))


def chat_request(*media_parts) -> messages.NewRequest:
    C = messages.ContentPart
    parts = [C(type="text", text="describe this image")]
    for kind, url in media_parts:
        if kind == "video":
            parts.append(C(type="text", text="and this video"))
        parts.append(C(type=f"{kind}_url", url=url))
    parts.append(C(type="text", text="what is in the picture"))
    return messages.NewRequest(request_id="r", model="q", sampling=messages.SamplingParams(),
                               messages=[messages.ChatMessage("user", parts)])


def test_preparer_is_qwen3_5s_and_parallel(preparer):
    from mstar_actors.prepare.preparers import Qwen3_5VLPreparer

    assert isinstance(preparer, Qwen3_5VLPreparer) and preparer.PREPROCESS_PARALLEL


def test_image_prompt_matches_the_processor(qwen3_5, preparer):
    from PIL import Image

    _, hf, processor = qwen3_5
    array = np.random.default_rng(4).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    draft = preparer.draft(chat_request(("image", png_url(array))), {})
    out = processor_inputs(processor, image=Image.fromarray(array))
    assert draft.prepared.prompt_token_ids == out["input_ids"][0].tolist()
    [item] = draft.media
    assert torch.equal(item.pixel_values, out["pixel_values"].float())
    assert item.grid_thw == tuple(out["image_grid_thw"][0].tolist())
    assert [m.token_offset for m in items_of(out["input_ids"][0].tolist(), out, hf.config.image_token_id, -1)] == [item.token_offset]


def test_video_prompt_matches_the_processor(qwen3_5, preparer, torchvision_normalize):
    from mstar_actors.models.vision import PixelNorm
    from mstar_actors.prepare.media import MediaLimits, MediaRef, decode_video
    from mstar_actors.prepare.preparers import video_pixel_constants

    _, hf, processor = qwen3_5
    url = mp4_url(video_frames(10, 64, 96, seed=6), fps=4)  # 2.5 s: 5 frames at 2 fps, 3 temporal patches
    draft = preparer.draft(chat_request(("video", url)), {})
    assert not isinstance(draft, messages.Failed), draft
    from mstar_actors.prepare.media import read_local

    ref = MediaRef("video", url, "messages[0].content[2]")
    frames = decode_video(read_local(ref, MediaLimits()), ref, MediaLimits(video_fps=2.0)).frames
    assert frames.shape[0] == 5
    out = processor_inputs(processor, frames=frames, fps=2.0)
    ids = out["input_ids"][0].tolist()
    assert draft.prepared.prompt_token_ids == ids
    expected_items = items_of(ids, out, -1, hf.config.video_token_id)
    assert [(m.token_offset, m.num_tokens, m.grid_thw) for m in draft.media] == \
        [(m.token_offset, m.num_tokens, tuple(m.grid_thw)) for m in expected_items]
    rows = torch.cat([m.pixel_values for m in draft.media])
    assert rows.dtype == torch.uint8
    norm = PixelNorm(*video_pixel_constants(preparer.video_processor), rows.shape[1] // 3)
    assert torch.equal(norm(rows), out["pixel_values_videos"])


def test_video_resize_is_qwen3_vls(preparer):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    from mstar_actors.prepare.preparers import qwen3_5_video_patches

    vp = preparer.video_processor
    for num_frames, height, width in [(4, 64, 96), (5, 50, 70), (2, 300, 200), (3, 20, 20)]:
        frames = np.zeros((num_frames, height, width, 3), dtype=np.uint8)
        _, (t, h, w) = qwen3_5_video_patches(frames, vp)
        rh, rw = smart_resize(max(num_frames, 2), height, width, temporal_factor=2, factor=32,
                              min_pixels=vp.size["shortest_edge"], max_pixels=vp.size["longest_edge"])
        assert (t, h * 16, w * 16) == ((num_frames + 1) // 2, rh, rw)
