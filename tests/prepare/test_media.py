"""Media input on files the tests make: data/file/http URLs, each limit, corrupt input."""

from __future__ import annotations

import base64
import re
import fractions
import io
import struct
import zlib

import numpy as np
import pytest

from mstar_actors.prepare.media import (
    MediaError,
    MediaLimits,
    MediaRef,
    collect_media,
    decode_image,
    decode_video,
    fetch_remote,
    read_local,
)
from mstar_actors.messages import ChatMessage, ContentPart, NewRequest, SamplingParams
from tests.loopback import serving

PARAM = "messages[0].content[1].image_url"


def png_bytes(size=(32, 24), fmt="PNG") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def bomb_png(width=100_000, height=100_000) -> bytes:
    """A valid PNG header claiming a huge canvas, with almost no data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def video_bytes(seconds: float = 3.0, fps: int = 10, size: int = 64, start_s: float = 0.0, fmt: str = "mp4") -> bytes:
    """A clip of one grey a frame; ``start_s``: its first frame's timestamp
    (an MPEG-TS cut from a stream starts past 0; ffmpeg's own start at 1.4 s)."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(int(seconds * fps)):
            img = np.full((size, size, 3), (i * 7) % 255, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts, frame.time_base = round(start_s * fps) + i, fractions.Fraction(1, fps)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def ref(url: str, kind: str = "image") -> MediaRef:
    return MediaRef(kind, url, PARAM)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# ---- data: and file:// ----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_data_url_image_decodes(fmt):
    data = png_bytes(fmt=fmt)
    got = read_local(ref(data_url(data, f"image/{fmt.lower()}")), MediaLimits())
    assert got == data
    image = decode_image(got, ref(""), MediaLimits())
    assert image.size == (32, 24) and image.mode == "RGB"


def test_data_url_must_be_base64():
    with pytest.raises(MediaError, match="base64") as err:
        read_local(ref("data:image/png,rawtext"), MediaLimits())
    assert err.value.param == PARAM
    with pytest.raises(MediaError, match="not valid base64"):
        read_local(ref("data:image/png;base64,@@@@"), MediaLimits())


def test_an_input_audio_s_bad_base64_is_told_of_its_data_not_a_data_url():
    """The client sent base64 alone (``input_audio.data``): the data: URL prepare reads is the frontend's."""
    audio = MediaRef("audio", "data:audio/wav;base64,QUJ@é", "messages[0].content[0].input_audio")
    non_ascii = r"input_audio: its data is not valid base64: a non-ASCII character at position 4$"
    with pytest.raises(MediaError, match=non_ascii):
        read_local(audio, MediaLimits())
    with pytest.raises(MediaError, match="its data is not valid base64") as err:
        read_local(MediaRef("audio", "data:audio/wav;base64,@@@!!", audio.param), MediaLimits())
    assert "data: URL" not in str(err.value) and err.value.param == audio.param


def test_file_url_inside_the_allowed_dir(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes())
    limits = MediaLimits(allowed_dir=str(tmp_path))
    assert read_local(ref(f"file://{tmp_path}/a.png"), limits) == (tmp_path / "a.png").read_bytes()


def test_file_url_outside_the_allowed_dir_is_refused(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(png_bytes())
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    limits = MediaLimits(allowed_dir=str(allowed))
    for url in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png", f"file://{allowed}/link.png"):
        with pytest.raises(MediaError, match="outside server.allowed_media_dir"):
            read_local(ref(url), limits)
    for missing in ("missing.png", "a%00.png"):  # a NUL byte names no file either
        with pytest.raises(MediaError, match="no such file"):
            read_local(ref(f"file://{allowed}/{missing}"), limits)
    with pytest.raises(MediaError, match="allowed_media_dir is not set"):
        read_local(ref(f"file://{allowed}/link.png"), MediaLimits())


# ---- limits -----------------------------------------------------------------------


def test_bytes_limit(tmp_path):
    data = png_bytes()
    limits = MediaLimits(max_bytes=len(data) - 1, allowed_dir=str(tmp_path))
    with pytest.raises(MediaError, match="server.max_media_bytes"):
        read_local(ref(data_url(data)), limits)
    (tmp_path / "a.png").write_bytes(data)
    with pytest.raises(MediaError, match="server.max_media_bytes"):
        read_local(ref(f"file://{tmp_path}/a.png"), limits)


def test_pixel_limit_and_decompression_bomb_refused_from_the_header():
    with pytest.raises(MediaError, match=r"32x24 = 768 pixels.*server.max_image_pixels"):
        decode_image(png_bytes(), ref(""), MediaLimits(max_image_pixels=767))
    with pytest.raises(MediaError, match="server.max_image_pixels") as err:  # Pillow's own guard, at open
        decode_image(bomb_png(), ref(""), MediaLimits())
    assert "the image has 10000000000 pixels" in str(err.value)  # its size, as Pillow read it
    assert err.value.param == PARAM
    with pytest.warns(Warning), pytest.raises(MediaError, match=r"20000x20000 = 400000000 pixels"):  # ours first
        decode_image(bomb_png(20_000, 20_000), ref(""), MediaLimits(max_image_pixels=10**9 // 4))


def test_corrupt_files_fail_with_the_reason():
    with pytest.raises(MediaError, match="could not decode the image"):
        decode_image(b"not an image at all", ref(""), MediaLimits())
    with pytest.raises(MediaError, match="could not decode the image"):
        decode_image(png_bytes()[:60], ref(""), MediaLimits())
    with pytest.raises(MediaError, match="could not decode the video: its bytes are no container") as err:
        decode_video(b"\0" * 1000, ref("", "video"), MediaLimits())
    assert "Errno" not in str(err.value)
    with pytest.raises(MediaError, match="could not decode the video: the file is empty"):
        decode_video(b"", ref("", "video"), MediaLimits())


def test_items_per_request_and_scheme():
    parts = [ContentPart(type="text", text="hi")] + [ContentPart(type="image_url", url="data:,") for _ in range(3)]
    req = NewRequest(request_id="r", model="m", sampling=SamplingParams(), messages=[ChatMessage("user", parts)])
    assert [r.param for r in collect_media(req, MediaLimits())] == [f"messages[0].content[{j}].image_url" for j in (1, 2, 3)]
    with pytest.raises(MediaError, match=r"messages\[0\].content\[3\].image_url: .*at most 2.*server.max_media_items"):
        collect_media(req, MediaLimits(max_items=2))
    bad = NewRequest(request_id="r", model="m", sampling=SamplingParams(),
                     messages=[ChatMessage("user", [ContentPart(type="video_url", url="ftp://x/v.mp4")])])
    with pytest.raises(MediaError, match=r"video_url: the url must be a data:, http\(s\)://"):
        collect_media(bad, MediaLimits())


# ---- video ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def video3s() -> bytes:
    return video_bytes(seconds=3.0, fps=10)


def test_video_sampled_at_the_configured_fps(video3s):
    got = decode_video(video3s, ref("", "video"), MediaLimits(video_fps=2.0))
    assert got.frames.shape == (6, 64, 64, 3) and got.fps == 2.0
    assert decode_video(video3s, ref("", "video"), MediaLimits(video_fps=10.0)).frames.shape[0] == 30


def test_video_decoded_on_ffmpeg_threads_gives_the_same_frames(video3s):
    one = decode_video(video3s, ref("", "video"), MediaLimits(video_fps=2.0))
    many = decode_video(video3s, ref("", "video"), MediaLimits(video_fps=2.0), num_threads=3)
    assert np.array_equal(one.frames, many.frames)


def test_video_frame_and_second_limits(video3s):
    with pytest.raises(MediaError, match="server.max_video_frames"):
        decode_video(video3s, ref("", "video"), MediaLimits(video_fps=2.0, max_video_frames=5))
    with pytest.raises(MediaError, match=r"3.0 s long.*server.max_video_seconds"):
        decode_video(video3s, ref("", "video"), MediaLimits(max_video_seconds=2.0))


@pytest.mark.parametrize("fmt", ["mpegts", "matroska"])
@pytest.mark.parametrize("start_s", [1.4, 60.0])
def test_a_videos_first_timestamp_changes_neither_its_frames_nor_its_limits(fmt, start_s):
    """Sampled from its first frame: a 4 s clip whose timestamps start at
    ``start_s`` gives the frames of the same clip from 0, evenly spaced, and
    passes the same limits (8 frames, 10 s)."""
    limits = MediaLimits(video_fps=2.0, max_video_frames=8, max_video_seconds=10.0)
    at_zero = decode_video(video_bytes(4.0, fps=20, fmt=fmt), ref("", "video"), limits)
    late = decode_video(video_bytes(4.0, fps=20, start_s=start_s, fmt=fmt), ref("", "video"), limits)
    assert at_zero.frames.shape[0] == 8 and np.array_equal(late.frames, at_zero.frames)


def test_a_gap_in_a_video_gives_no_burst_of_frames():
    """Frames at 0-0.95 s, then 3-3.95 s at 20 fps, sampled at 2 fps: 0, 0.5,
    then 3.0 and 3.5 (the gap's sample times have no frames of their own)."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="matroska") as container:
        stream = container.add_stream("mpeg4", rate=20)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for i in [*range(20), *range(60, 80)]:
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i, dtype=np.uint8), format="rgb24")
            frame.pts, frame.time_base = i, fractions.Fraction(1, 20)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    got = decode_video(out.getvalue(), ref("", "video"), MediaLimits(video_fps=2.0))
    assert [round(float(f.mean())) for f in got.frames] == pytest.approx([0, 10, 60, 70], abs=2)


def test_a_videos_decoded_pixels_are_bounded_as_it_decodes(video3s):
    """6 sampled 64x64 frames hold 24,576 pixels: a bound of 5 frames' refuses
    it at the sixth, one of 6 keeps them all (in one buffer, no stacked copy)."""
    with pytest.raises(MediaError, match=r"over 20480 pixels \(6 frames of 64x64 so far\).*server.max_video_pixels"):
        decode_video(video3s, ref("", "video"), MediaLimits(video_fps=2.0, max_video_pixels=5 * 64 * 64))
    got = decode_video(video3s, ref("", "video"), MediaLimits(video_fps=2.0, max_video_pixels=6 * 64 * 64))
    assert got.frames.shape == (6, 64, 64, 3) and got.frames.flags["C_CONTIGUOUS"]


# ---- http(s) ------------------------------------------------------------------------


async def test_http_fetch_redirects_and_size_limit():
    from aiohttp import web

    image = png_bytes()

    async def big(request):
        resp = web.StreamResponse()  # no Content-Length: the limit holds while streaming
        await resp.prepare(request)
        for _ in range(64):
            await resp.write(b"\0" * 4096)
        return resp

    async def img(request):
        return web.Response(body=image)

    def redirect(to):
        async def handler(request):
            raise web.HTTPFound(to)
        return handler

    app = web.Application()
    app.router.add_get("/img.png", img)
    app.router.add_get("/moved", redirect("/img.png"))
    app.router.add_get("/loop", redirect("/loop"))
    app.router.add_get("/big", big)
    limits = MediaLimits(max_bytes=100_000, max_redirects=3, allow_private_addresses=True)  # the server is on loopback
    async with serving(app) as base:
        got = await fetch_remote([ref(f"{base}/img.png"), MediaRef("image", f"{base}/moved", "p2")], limits)
        assert got == {PARAM: image, "p2": image}
        with pytest.raises(MediaError, match="more than 3 redirects"):
            await fetch_remote([ref(f"{base}/loop")], limits)
        with pytest.raises(MediaError, match="server.max_media_bytes"):
            await fetch_remote([ref(f"{base}/big")], limits)
        with pytest.raises(MediaError, match="HTTP 404"):
            await fetch_remote([ref(f"{base}/nothing")], limits)


def test_data_url_decodes_as_b64decode_does_for_vllm():
    """The data: payload decoder (pybase64, which releases the GIL) gives base64's bytes; as Python's decoder
    reads it for vLLM, lines wrapped as base64 tools wrap them and a missing padding are taken; the rest is
    refused, saying what is wrong."""
    import random

    rng = random.Random(0)
    for n in (0, 1, 2, 3, 5, 6, 7, 12, 100, 100_000):
        payload = bytes(rng.randrange(256) for _ in range(n))
        assert read_local(ref(data_url(payload, "video/mp4")), MediaLimits()) == payload
        text = base64.b64encode(payload).decode()
        for lenient in ("\n".join(text[i : i + 76] for i in range(0, len(text), 76)) + "\n", text.rstrip("="),
                        " " + text.replace("A", "A\r\n", 3)):
            assert read_local(ref("data:video/mp4;base64," + lenient), MediaLimits()) == payload
    for bad, why in (("QUJD@EVG", "'@' is no base64 character"), ("QUJD-EVG", "'-' is no base64 character (URL-safe"),
                     ("QUJDRA==QUJD", 'an "=" stands before the end'),
                     ("QUJDR", "its 5 characters are one more than a multiple of 4"),
                     ("QUJDREVGé", "a non-ASCII character at position 30"), ("=QUJ", 'an "=" stands before the end')):
        with pytest.raises(MediaError, match="not valid base64: " + re.escape(why)) as err:
            read_local(ref("data:video/mp4;base64," + bad), MediaLimits())
        assert err.value.param == PARAM


def test_keep_freed_buffers_answers_without_raising():
    from mstar_actors.prepare.media import keep_freed_buffers

    assert keep_freed_buffers() in (True, False)  # glibc: True; elsewhere a no-op


def test_a_video_slower_than_the_sampling_rate_is_held_to_the_frames_it_has():
    """17 frames at 1 fps sampled at 2 fps give each frame once (17, under a
    limit of 32): its 17 s times 2 fps was refused as 34 frames before any
    was decoded."""
    clip = video_bytes(seconds=17.0, fps=1)
    got = decode_video(clip, ref("", "video"), MediaLimits(video_fps=2.0, max_video_frames=32, max_video_seconds=60))
    assert got.frames.shape[0] == 17
    with pytest.raises(MediaError, match="server.max_video_frames"):  # the frames it has still count
        decode_video(clip, ref("", "video"), MediaLimits(video_fps=2.0, max_video_frames=16, max_video_seconds=60))


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L", "CMYK"])
def test_an_image_is_made_rgb_as_the_models_processors_make_it(mode):
    """Transparent pixels over white, as transformers' ``convert_to_rgb``
    (and vLLM's loader for RGBA) give them: dropping the alpha showed the
    model the hidden colours."""
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    rng = np.random.default_rng(1)
    rgba = Image.fromarray(rng.integers(0, 255, (24, 32, 4), dtype=np.uint8), "RGBA")
    image = rgba.convert(mode) if mode != "P" else rgba.convert("RGB").quantize(16)
    if mode == "P":
        image.info["transparency"] = 3  # one palette entry transparent
    out = io.BytesIO()
    image.save(out, format="PNG" if mode != "CMYK" else "JPEG")
    got = decode_image(out.getvalue(), ref(""), MediaLimits())
    expected = convert_to_rgb(Image.open(io.BytesIO(out.getvalue())))
    assert got.mode == "RGB" and np.array_equal(np.asarray(got), np.asarray(expected))
    if mode in ("RGBA", "LA"):
        assert not np.array_equal(np.asarray(got), np.asarray(Image.open(io.BytesIO(out.getvalue())).convert("RGB")))
