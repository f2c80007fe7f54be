"""Qwen2.5-VL against transformers on a tiny random model: the vision tower
(window attention over several windows, images and videos), the multimodal
rotary positions, and greedy tokens through the runner with image, video and
text prompts served together (chunked prefill splitting a placeholder run,
a preemption that recomputes the vision rows)."""

from __future__ import annotations

import functools

import pytest
import torch

from mstar_actors import messages
from plan_driver import PlanDriver
from mstar_actors.runner.model_runner import PlanError
from runner_factories import make_runner
from mstar_actors.models.loader import load_model
from mstar_actors.models.qwen2_5_vl import mrope_positions
from mstar_actors.models.vision import window_order

from .vl_factories import (
    IMAGE_TOKEN,
    MERGE,
    TOKENS_PER_SECOND,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    FakeArena,
    make_hf_vl_model,
    make_pixels,
    num_media_tokens,
)

BLOCK_SIZE = 4
NUM_NEW = 16
GREEDY = messages.SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
IMAGE_GRID = (1, 6, 10)  # 3 x 5 merged cells: 2 x 3 windows of 2 x 2 cells, clipped at the edges
VIDEO_GRID = (2, 8, 8)  # 2 temporal patches of 4 x 4 merged cells: 4 windows each
SECONDS_PER_GRID = 1.0  # temporal positions 0 and 2 (tokens_per_second = 2)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    return folder, make_hf_vl_model(folder)


# -- the vision tower -------------------------------------------------------------------


@pytest.mark.parametrize("grids", [[IMAGE_GRID], [VIDEO_GRID], [IMAGE_GRID, VIDEO_GRID, (1, 12, 12)]], ids=["image", "video", "mixed"])
def test_vision_tower_matches_transformers(vl, grids):
    folder, hf = vl
    model = load_model(folder, torch.float32, "cpu")
    pixels = torch.cat([make_pixels(g, seed=i) for i, g in enumerate(grids)])
    with torch.no_grad():
        expected = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    with torch.inference_mode():
        ours = model.encode_media(pixels, grids)
    assert ours.shape == (sum(num_media_tokens(g) for g in grids), 64)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_windows_are_clipped_at_frame_edges():
    _, bounds = window_order([IMAGE_GRID, VIDEO_GRID], MERGE, cells_per_window=2)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    # image: 3 x 5 cells -> windows of 2x2, 2x2, 2x1, 1x2, 1x2, 1x1 cells (4 patches each); video: 2 frames x 4 full windows
    assert sizes == [16, 16, 8, 8, 8, 4] + [16] * 8


# -- multimodal rotary positions ----------------------------------------------------------


def test_mrope_positions_match_get_rope_index(vl):
    _, hf = vl
    arena = FakeArena()
    prompt, media, _ = media_prompt([("text", 3), ("image", IMAGE_GRID), ("text", 4), ("video", VIDEO_GRID), ("text", 2)], arena)
    ours, delta = mrope_positions(len(prompt), media, MERGE, TOKENS_PER_SECOND)
    kwargs = {k: v for k, v in hf_media_kwargs(prompt, media, arena).items() if "pixel" not in k}
    expected, expected_delta = hf.model.get_rope_index(torch.tensor([prompt]), **kwargs)
    assert torch.equal(ours, expected[:, 0]) and delta == expected_delta.item()


def test_mrope_text_after_a_long_video_continues_after_its_last_frame():
    item = messages.MediaItem("video", messages.TensorRef("v", 0, 0, "float32", ()), (4, 2, 2), 1, 4, second_per_grid_t=2.0)
    positions, delta = mrope_positions(7, [item], MERGE, TOKENS_PER_SECOND)
    assert positions[0].tolist() == [0, 1, 5, 9, 13, 14, 15]  # t steps of 4; text resumes at 13 + 1
    assert positions[1].tolist() == [0, 1, 1, 1, 1, 14, 15]
    assert delta == 16 - 7


# -- the runner against generate -----------------------------------------------------------


def media_prompt(parts, arena: FakeArena, seed: int = 0) -> tuple[list[int], list[messages.MediaItem], dict]:
    """A prompt from ("text", n) / ("image"|"video", grid) parts, the MediaItems
    the prepare side would send, and the pixel tensors by kind."""
    gen = torch.Generator().manual_seed(seed)
    prompt, media, pixels = [], [], {"image": [], "video": []}
    for i, (kind, arg) in enumerate(parts):
        if kind == "text":
            prompt += torch.randint(3, IMAGE_TOKEN, (arg,), generator=gen).tolist()
            continue
        px = make_pixels(arg, seed=seed * 100 + i)
        pixels[kind].append(px)
        ref = arena.store(f"{seed}-{i}", px)
        prompt.append(VISION_START)
        num = num_media_tokens(arg)
        spg = SECONDS_PER_GRID if kind == "video" else 0.0
        media.append(messages.MediaItem(kind, ref, arg, len(prompt), num, second_per_grid_t=spg))
        prompt += [IMAGE_TOKEN if kind == "image" else VIDEO_TOKEN] * num + [VISION_END]
    return prompt, media, pixels


def hf_media_kwargs(prompt, media, arena) -> dict:
    """What transformers' processor would return next to input_ids."""
    kwargs = {"mm_token_type_ids": torch.tensor([[1 if t == IMAGE_TOKEN else 2 if t == VIDEO_TOKEN else 0 for t in prompt]])}
    for kind, key, grid_key in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        items = [m for m in media if m.kind == kind]
        if items:
            kwargs[key] = torch.cat([arena.resolve(m.pixel_values) for m in items])
            kwargs[grid_key] = torch.tensor([m.grid_thw for m in items])
    if any(m.kind == "video" for m in media):
        kwargs["second_per_grid_ts"] = torch.tensor([m.second_per_grid_t for m in media if m.kind == "video"])
    return kwargs


def reference(hf, prompt, media, arena) -> list[int]:
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False, **hf_media_kwargs(prompt, media, arena))
    return out[0, len(prompt) :].tolist()


Driver = functools.partial(PlanDriver, block_size=BLOCK_SIZE, num_new=NUM_NEW, sampling=GREEDY)


class CountingTower:
    """Wraps ``encode_media`` to count how many items the tower encoded."""

    def __init__(self, model):
        self.calls: list[int] = []
        self.inner = model.encode_media
        model.encode_media = self

    def __call__(self, pixels, grids):
        self.calls.append(len(grids))
        return self.inner(pixels, grids)


def test_runner_matches_generate_for_image_video_and_text_prompts(vl):
    folder, hf = vl
    arena = FakeArena()
    prompts = {
        "img": media_prompt([("text", 5), ("image", IMAGE_GRID), ("text", 6)], arena, seed=1),
        "vid": media_prompt([("text", 3), ("video", VIDEO_GRID), ("text", 4)], arena, seed=2),
        "mix": media_prompt([("text", 2), ("image", (1, 4, 4)), ("text", 3), ("video", VIDEO_GRID), ("text", 3)], arena, seed=3),
        "txt": media_prompt([("text", 21)], arena, seed=4),
    }
    runner = make_runner(folder, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=128, resolve_tensor=arena.resolve)
    tower = CountingTower(runner.model)
    d = Driver(runner)
    starts = [d.start(rid, p, m) for rid, (p, m, _) in prompts.items()]
    # img's 15-token image run starts at 6: chunks of 10 and 9 split it at 10;
    # vid's 32-token run starts at 4: 3 chunks split it twice.
    d.step(starts, [d.chunk("img", 10), d.chunk("vid", 12), d.chunk("txt", 8)])
    d.step([], [d.chunk("img", 9), d.chunk("vid", 12), d.chunk("txt"), d.chunk("mix", 20)])
    d.step([], [d.chunk("img"), d.chunk("vid"), d.chunk("mix"), *d.decodes("txt")])
    # Step 1: img's image, vid's video; step 2: mix's image and video (its
    # chunk ends inside the video run); step 3: nothing new. Each item once.
    assert tower.calls == [2, 2]
    while len(d.seqs["vid"]["outputs"]) < 5:
        d.step([], d.decodes("img", "vid", "mix", "txt"))
    # Preempt vid, then restart it with its outputs; its vision rows are recomputed.
    vid_outputs = list(d.seqs["vid"]["outputs"])
    d.step([], d.decodes("img", "mix", "txt"), finished=[d.finish("vid")])
    restart = d.start("vid", prompts["vid"][0], prompts["vid"][1], vid_outputs)
    d.step([restart], [d.chunk("vid", 20), *d.decodes("img", "mix", "txt")])
    d.step([], [d.chunk("vid"), *d.decodes("img", "mix", "txt")])
    while chunks := d.decodes("img", "vid", "mix", "txt"):
        d.step([], chunks)
    assert tower.calls == [2, 2, 1]
    assert runner.media.seqs["img"].rows == {}  # consumed runs keep no vision rows
    for rid, (prompt, media, _) in prompts.items():
        assert d.seqs[rid]["outputs"] == reference(hf, prompt, media, arena), f"sequence {rid} diverged"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_tokens=14), "num_tokens=14, but grid_thw"),
        (dict(token_offset=5), r"prompt tokens \[5, 20\) must all be the image token 300"),
        (dict(grid_thw=(1, 5, 10)), "multiples of 2"),
        (dict(kind="audio"), "kind 'audio' is not supported"),
    ],
)
def test_bad_media_fails_only_its_request(vl, change, message):
    folder, _ = vl
    arena = FakeArena()
    prompt, media, _ = media_prompt([("text", 5), ("image", IMAGE_GRID)], arena)
    bad = messages.MediaItem(**({f: getattr(media[0], f) for f in media[0].__struct_fields__} | change))
    runner = make_runner(folder, dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=32, resolve_tensor=arena.resolve)
    d = Driver(runner)
    with pytest.raises(PlanError, match=message) as err:
        d.step([d.start("bad", prompt, [bad]), d.start("ok", [5, 6, 7])], [])
    assert err.value.request_ids == ["bad"] and "ok" in runner.seqs


def test_checkpoint_in_transformers5_layout_loads_the_same(vl, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = vl
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    renamed = {("model.language_model." + k[6:]) if k.startswith("model.") else ("model." + k) if k.startswith("visual.") else k: v for k, v in tensors.items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    ours, original = load_model(tmp_path, torch.float32, "cpu"), load_model(folder, torch.float32, "cpu")
    for (name, a), (_, b) in zip(ours.state_dict().items(), original.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
