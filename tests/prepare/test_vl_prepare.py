"""Qwen2.5-VL preparation: placeholders expanded to the processor's patch grid,
pixel rows equal to transformers' image processor, and the actor sending media
through the arena, each request once ready."""

from __future__ import annotations

import base64
import copy
import io

import numpy as np
import pytest
import torch

from mstar_actors.prepare.media import MediaLimits
from mstar_actors.messages import (
    ChatMessage,
    ContentPart,
    Failed,
    NewRequest,
    Prepared,
    SamplingParams,
)
from mstar_actors.prepare.preparers import Draft, Preparer, QwenVLPreparer, load_preparer
from tests import vl_fixtures
from tests.prepare.actor_kit import running_prepare_actor


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    return vl_fixtures.save_vl_prepare_folder(tmp_path_factory.mktemp("vl"), max_pixels=28 * 28 * 64)


@pytest.fixture(scope="module")
def preparer(vl_folder):
    return load_preparer(vl_fixtures.vl_prepare_info(vl_folder), MediaLimits(video_fps=2.0))


def png_url(array: np.ndarray) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def still_video_url(frame: np.ndarray, seconds: int = 1, fps: int = 4) -> str:
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mjpeg", rate=fps)  # intra-only: frames come back nearly exact
        stream.width, stream.height, stream.pix_fmt = frame.shape[1], frame.shape[0], "yuvj444p"
        for _ in range(seconds * fps):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(out.getvalue()).decode()


def chat(rid: str, *parts: ContentPart) -> NewRequest:
    return NewRequest(request_id=rid, model="vl", sampling=SamplingParams(),
                      messages=[ChatMessage("user", [ContentPart(type="text", text="describe this"), *parts])])


def image_part(url: str) -> ContentPart:
    return ContentPart(type="image_url", url=url)


def test_vl_is_parallel_and_text_is_not(preparer):
    assert isinstance(preparer, QwenVLPreparer) and preparer.PREPROCESS_PARALLEL
    assert not Preparer.PREPROCESS_PARALLEL


def test_image_placeholders_expand_to_the_processor_grid(preparer):
    from PIL import Image

    array = np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8)
    draft = preparer.draft(chat("r1", image_part(png_url(array)), ContentPart(type="text", text="and this")), {})
    assert isinstance(draft, Draft), draft
    [item] = draft.media
    expected = preparer.image_processor(images=[Image.fromarray(array)], return_tensors="pt")
    assert torch.equal(item.pixel_values, expected["pixel_values"].float())
    assert item.grid_thw == tuple(int(x) for x in expected["image_grid_thw"][0])
    t, h, w = item.grid_thw
    assert item.num_tokens == t * h * w // 4 and item.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
    ids = draft.prepared.prompt_token_ids
    span = ids[item.token_offset:item.token_offset + item.num_tokens]
    assert span == [vl_fixtures.IMAGE_TOKEN] * item.num_tokens and ids.count(vl_fixtures.IMAGE_TOKEN) == item.num_tokens
    assert ids[item.token_offset - 1] == 7 and ids[item.token_offset + item.num_tokens] == 8  # vision start/end


def test_video_rows_match_the_image_layout_for_a_still_clip(preparer):
    yy, xx = np.mgrid[0:56, 0:84]  # smooth, so the codec keeps it nearly exact
    frame = np.stack([yy * 4, xx * 3, (yy + xx) * 2], axis=-1).astype(np.uint8)
    draft = preparer.draft(chat("v1", ContentPart(type="video_url", url=still_video_url(frame))), {})
    assert isinstance(draft, Draft), draft
    [item] = draft.media
    assert item.kind == "video" and item.grid_thw[0] == 1  # 2 frames at 2 fps: one temporal patch
    assert item.second_per_grid_t == pytest.approx(1.0)  # temporal_patch_size / fps
    image = preparer.draft(chat("i1", image_part(png_url(frame))), {}).media[0]
    assert item.grid_thw == image.grid_thw
    video_rows = _normalize(item.pixel_values, preparer.image_processor)
    assert (video_rows - image.pixel_values).abs().mean() < 0.1  # codec noise only
    assert draft.prepared.prompt_token_ids.count(vl_fixtures.VIDEO_TOKEN) == item.num_tokens


def test_a_video_sent_as_vllm_s_jpeg_frames_equals_the_same_frames_as_a_clip(preparer):
    """``data:video/jpeg;base64,<frame>,<frame>``: the frames taken as sampled at video_fps, the same rows as
    a clip of those frames; frames of two sizes, or more than max_video_frames, are refused by the part."""
    from PIL import Image

    yy, xx = np.mgrid[0:56, 0:84]
    frame = np.stack([yy * 4, xx * 3, (yy + xx) * 2], axis=-1).astype(np.uint8)

    def jpeg(array: np.ndarray) -> str:
        out = io.BytesIO()
        Image.fromarray(array).save(out, format="JPEG", quality=95)
        return base64.b64encode(out.getvalue()).decode()

    frames = "data:video/jpeg;base64," + ",".join([jpeg(frame)] * 2)
    draft = preparer.draft(chat("f1", ContentPart(type="video_url", url=frames)), {})
    assert isinstance(draft, Draft), draft
    [item] = draft.media
    clip = preparer.draft(chat("v1", ContentPart(type="video_url", url=still_video_url(frame))), {}).media[0]
    assert (item.kind, item.grid_thw, item.num_tokens) == ("video", clip.grid_thw, clip.num_tokens)
    assert item.second_per_grid_t == pytest.approx(clip.second_per_grid_t)
    assert (item.pixel_values.float() - clip.pixel_values.float()).abs().mean() < 2  # JPEG against mjpeg: levels
    for url, why in (("data:video/jpeg;base64," + jpeg(frame) + "," + jpeg(frame[:28]), "frame 1 is 84x28"),
                     ("data:video/jpeg;base64," + ",".join([jpeg(frame)] * 65), "at most 64 (server.max_video_frames)"),
                     ("data:video/jpeg;base64," + jpeg(frame) + ",@@",
                      "video_url: frame 1: the data: URL is not valid"),
                     ("data:video/jpeg;base64," + jpeg(frame) + "," + base64.b64encode(b"GIF8").decode(),
                      "video_url: frame 1: ")):
        failed = preparer.draft(chat("bad", ContentPart(type="video_url", url=url)), {})
        assert why in failed.message and "messages[0].content[1].video_url" in failed.message, failed
        assert failed.param == "messages[0].content[1].video_url", failed  # the field, as a client maps it


def test_video_patch_layout_equals_the_image_processor_for_repeated_frames(preparer):
    from PIL import Image

    from mstar_actors.prepare.preparers import video_patches

    frame = np.random.default_rng(2).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    ip = preparer.image_processor
    rows, grid = video_patches(np.stack([frame, frame]), ip, preparer.min_pixels, preparer.max_pixels)
    rows = _normalize(rows, ip)
    out = ip(images=[Image.fromarray(frame)], return_tensors="pt")
    expected = out["pixel_values"].float()
    assert grid == tuple(int(x) for x in out["image_grid_thw"][0])
    # The image processor resizes with Pillow's bicubic, videos with torch's (as transformers'
    # video processor): they differ by at most 2 of 255 levels in a few values, so the layout
    # and normalization are checked exactly everywhere else.
    level = 1 / 255 / min(ip.image_std)
    diff = (rows - expected).abs()
    assert diff.max() <= 2 * level + 1e-5 and (diff > 1e-5).float().mean() < 0.02
    three, grid3 = video_patches(np.stack([frame] * 3), ip, preparer.min_pixels, preparer.max_pixels)
    assert grid3[0] == 2 and torch.equal(_normalize(three, ip)[rows.shape[0]:], rows)  # padded with the last frame


def _normalize(rows, ip):
    """What the vision tower does to raw rows on the rank."""
    from mstar_actors.models.vision import PixelNorm

    return PixelNorm(ip.image_mean, ip.image_std, ip.rescale_factor, rows.shape[1] // 3)(rows)


def _patches_normalized_first(frames, ip, min_pixels, max_pixels):
    """The layout as first written, with transformers' video resize (torchvision's
    ``resize`` of a uint8 CPU tensor: ``interpolate`` bicubic, antialias, on uint8):
    normalize float frames, then permute. The reference for the rows."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    p, m, tps = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    rh, rw = smart_resize(frames.shape[1], frames.shape[2], factor=p * m, min_pixels=min_pixels, max_pixels=max_pixels)
    u8 = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    u8 = torch.nn.functional.interpolate(u8, size=(rh, rw), mode="bicubic", antialias=True, align_corners=False)
    x = u8.float() * float(ip.rescale_factor)
    x = (x - torch.tensor(ip.image_mean).view(1, 3, 1, 1)) / torch.tensor(ip.image_std).view(1, 3, 1, 1)
    if len(frames) % tps:
        x = torch.cat([x, x[-1:].expand(tps - len(frames) % tps, -1, -1, -1)])
    t, gh, gw = x.shape[0] // tps, rh // p, rw // p
    x = x.reshape(t, tps, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, 3 * tps * p * p)


@pytest.mark.parametrize("num_frames", [3, 4])
def test_video_rows_equal_transformers_video_resize_and_layout_bit_for_bit(preparer, num_frames):
    from mstar_actors.prepare.preparers import video_patches

    frames = np.random.default_rng(num_frames).integers(0, 255, (num_frames, 45, 61, 3), dtype=np.uint8)
    ip = preparer.image_processor
    rows, grid = video_patches(frames, ip, preparer.min_pixels, preparer.max_pixels)
    assert grid[0] == 2 and rows.dtype == torch.uint8 and rows.is_contiguous()  # raw: a quarter of the bytes
    assert torch.equal(_normalize(rows, ip), _patches_normalized_first(frames, ip, preparer.min_pixels, preparer.max_pixels))


def test_media_digests_follow_the_source_bytes_and_the_place(preparer):
    frame = np.random.default_rng(3).integers(0, 255, (40, 40, 3), dtype=np.uint8)
    other = frame.copy()
    other[0, 0] ^= 1
    a1, a2 = (preparer.draft(chat(r, image_part(png_url(frame))), {}) for r in ("a1", "a2"))
    b = preparer.draft(chat("b", image_part(png_url(other))), {})
    moved = preparer.draft(chat("m", ContentPart(type="text", text="and"), image_part(png_url(frame))), {})
    assert a1.media[0].source_digest and a1.prepared.media_digests == a2.prepared.media_digests
    assert b.prepared.media_digests != a1.prepared.media_digests  # one pixel apart
    assert moved.prepared.media_digests != a1.prepared.media_digests  # same image, later in the prompt


def test_low_detail_sees_a_512_square_version_and_keys_its_own_prefix(preparer):
    """OpenAI's ``detail: "low"``: the image shrunk (aspect kept) to fit 512 x
    512 before the processor, so fewer tokens for a large one, nothing changed
    for a small one; its pixels differ, so its media digest does too."""
    from PIL import Image

    big = copy.copy(preparer)  # a processor that keeps large images large
    big.image_processor = type(preparer.image_processor)(min_pixels=56 * 56, max_pixels=2048 * 2048)
    array = np.random.default_rng(5).integers(0, 255, (600, 1200, 3), dtype=np.uint8)
    url = png_url(array)
    high = big.draft(chat("h", ContentPart(type="image_url", url=url, detail="high")), {})
    low = big.draft(chat("l", ContentPart(type="image_url", url=url, detail="low")), {})
    shrunk = Image.fromarray(array).resize((512, 256), Image.Resampling.BICUBIC)
    expected = big.image_processor(images=[shrunk], return_tensors="pt")
    assert low.media[0].grid_thw == tuple(int(x) for x in expected["image_grid_thw"][0])
    assert low.media[0].num_tokens < high.media[0].num_tokens
    assert low.prepared.media_digests != high.prepared.media_digests
    small = png_url(array[:40, :40])
    a, b = (big.draft(chat(r, ContentPart(type="image_url", url=small, detail=d)), {}) for r, d in (("a", None),
                                                                                                   ("b", "low")))
    assert torch.equal(a.media[0].pixel_values, b.media[0].pixel_values)


def test_text_only_request_takes_the_plain_path(preparer):
    req = NewRequest(request_id="t", model="vl", sampling=SamplingParams(), prompt="describe this image")
    draft = preparer.draft(req, {})
    assert isinstance(draft, Draft) and not draft.media and draft.prepared.prompt_param == "prompt"


def test_a_media_placeholder_written_as_text_is_refused_by_its_part(preparer):
    """Was blamed on the chat template ("wrote 6 placeholders for 1 media
    parts"), and with no media part went on with a placeholder and no item."""
    from mstar_actors.messages import Failed

    token = preparer.tokenization.tokenizer.convert_ids_to_tokens(preparer.placeholders["image"])
    good = png_url(np.zeros((40, 40, 3), dtype=np.uint8))
    req = chat("p", ContentPart(type="text", text=f"look {token}{token}"), image_part(good))
    refused = preparer.draft(req, {})
    assert isinstance(refused, Failed) and refused.status == 400 and refused.param == "messages[0].content[1].text"
    assert token in refused.message and "image_url" in refused.message
    plain = NewRequest(request_id="q", model="vl", sampling=SamplingParams(),
                       messages=[ChatMessage("user", f"what is {token}?")])
    refused = preparer.draft(plain, {})
    assert isinstance(refused, Failed) and refused.param == "messages[0].content"
    for prompt in ({"prompt": f"what is {token}?"}, {"prompt_token_ids": [1, preparer.placeholders["image"], 2]}):
        refused = preparer.draft(NewRequest(request_id="c", model="vl", sampling=SamplingParams(), **prompt), {})
        assert isinstance(refused, Failed) and refused.status == 400 and refused.param == "prompt", prompt


async def test_actor_sends_media_through_the_arena_in_order(preparer):
    arena = vl_fixtures.HeapArena()
    async with running_prepare_actor(preparer, arena=arena, inbox_bytes=1 << 22) as (inbox, out):
        good = png_url(np.zeros((40, 40, 3), dtype=np.uint8))
        await inbox.send(chat("a", image_part(good)))
        await inbox.send(chat("b", image_part("data:image/png;base64," + base64.b64encode(b"junk").decode())))
        await inbox.send(NewRequest(request_id="c", model="vl", sampling=SamplingParams(), prompt="describe this"))
        a, b, c = sorted([await out.recv() for _ in range(3)], key=lambda r: r.request_id)  # each once ready
        assert isinstance(a, Prepared) and a.media[0].pixel_values.segment == "heap"
        assert tuple(arena.tensors[a.media[0].pixel_values.offset].shape) == a.media[0].pixel_values.shape
        assert isinstance(b, Failed) and b.status == 400 and b.param == "messages[0].content[1].image_url"
        assert "could not decode the image" in b.message
        assert isinstance(c, Prepared) and not c.media
        assert len(arena.tensors) == 1  # the failed request stored nothing


async def test_media_that_cannot_all_be_stored_are_a_413_and_give_back_what_was_stored(preparer, tmp_path):
    """A request of two images, the second's tensor larger than the whole
    arena: a 413 naming the limit, and nothing of it left in the arena (a
    request's tensors are stored all or none; a first block stored and handed
    to no worker used to stay, and the arena, freeing oldest first, filled up
    behind it for good)."""
    import os

    from transport import cleanup_run
    from transport.arena import TensorArena, create_arena

    run_id = f"t{os.getpid()}xprep"
    spec = create_arena(tmp_path, run_id, "media", 256 << 10)
    producer = TensorArena(spec, "producer")
    try:
        small, big = png_url(np.zeros((40, 40, 3), dtype=np.uint8)), png_url(np.zeros((224, 224, 3), dtype=np.uint8))
        async with running_prepare_actor(preparer, arena=producer, inbox_bytes=1 << 22) as (inbox, out):
            await inbox.send(chat("a", image_part(small), image_part(big)))
            failed = await out.recv()
            assert isinstance(failed, Failed) and failed.status == 413 and failed.code == "media_too_large", failed
            assert "transport.arena_bytes" in failed.message
            assert failed.param == "messages[0].content[2].image_url" and failed.message.startswith(failed.param)
            assert producer.num_bytes_in_use == 0  # the small image's block was given back
            await inbox.send(chat("b", image_part(small)))
            assert isinstance(await out.recv(), Prepared)
    finally:
        producer.close()
        cleanup_run(run_id, tmp_path)


async def test_media_that_fit_the_arena_alone_but_not_together_are_a_413_at_once(preparer, tmp_path):
    """Items each smaller than the arena but together larger would wait on each other (a request's tensors
    are freed only once a worker has read them all): a 413 naming the limit at once, not a 30 s wait and a
    503 asking to retry; the next request goes on."""
    import os
    import time

    from transport import cleanup_run
    from transport.arena import TensorArena, create_arena

    run_id = f"t{os.getpid()}yprep"
    spec = create_arena(tmp_path, run_id, "media", 256 << 10)
    producer = TensorArena(spec, "producer")
    try:
        image = png_url(np.zeros((64, 64, 3), dtype=np.uint8))
        async with running_prepare_actor(preparer, arena=producer, inbox_bytes=1 << 22) as (inbox, out):
            await inbox.send(chat("one", image_part(image)))
            one = await out.recv()
            assert isinstance(one, Prepared), one
            size = one.media[0].pixel_values.nbytes
            copies = spec.capacity_bytes // size + 1
            assert 1 < copies <= 8, copies  # within the request's media items
            started = time.perf_counter()
            await inbox.send(chat("many", *[image_part(image)] * copies))
            failed = await out.recv()
            assert isinstance(failed, Failed) and failed.status == 413 and failed.code == "media_too_large", failed
            assert "transport.arena_bytes" in failed.message and time.perf_counter() - started < 5
    finally:
        producer.close()
        cleanup_run(run_id, tmp_path)


@pytest.mark.parametrize("shape", [(1, 4000, 3), (4000, 1, 3)])
def test_an_image_the_processor_refuses_is_a_400_naming_its_part(preparer, shape):
    """Qwen's resize refuses an aspect ratio past 200: the item's 400, named by its part."""
    out = preparer.draft(chat("r", image_part(png_url(np.zeros(shape, dtype=np.uint8)))), {})
    assert isinstance(out, Failed) and out.status == 400 and out.param == "messages[0].content[1].image_url", out
    assert "aspect ratio" in out.message and "can't be prepared" in out.message


def test_a_draft_whose_client_left_stops_before_its_next_item(preparer):
    """The pool's thread asks between items: a request abandoned while its first image is prepared prepares no
    other (six large images held the only thread seconds after their client had gone)."""
    frame = np.random.default_rng(3).integers(0, 255, (40, 40, 3), dtype=np.uint8)
    req = chat("gone", *[image_part(png_url(frame))] * 3)
    asked = []
    result = preparer.draft(req, {}, abandoned=lambda: asked.append(1) or len(asked) > 1)
    assert isinstance(result, Failed) and "abandoned" in result.message and len(asked) == 2
    assert isinstance(preparer.draft(req, {}, abandoned=lambda: False), Draft)
    # inside a clip: asked at each decoded frame, it stops where its client left
    clip = chat("clip", ContentPart(type="video_url", url=still_video_url(frame, seconds=4, fps=4)))
    asked.clear()
    result = preparer.draft(clip, {}, abandoned=lambda: asked.append(1) or len(asked) > 3)
    assert isinstance(result, Failed) and "abandoned" in result.message and len(asked) == 4  # of 1 + 16
