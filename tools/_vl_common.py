"""What the VL benchmarks share: the video clip they prepare and serve, its
command-line forms, and data: URLs and requests carrying it."""

from __future__ import annotations

import argparse
import base64
import io
import math
from typing import NamedTuple

HEAVY_CLIP = (640, 480, 16.0)  # 32 frames, a draft of 250-600 ms on one core: where a pool of drafts pays off


class Clip(NamedTuple):
    """The benchmark's video: ``seconds`` long at ``width`` x ``height``,
    encoded at 24 fps, sampled by the server at ``fps``."""

    seconds: float = 4.0
    width: int = 320
    height: int = 240
    fps: float = 2.0

    @property
    def num_frames(self) -> int:  # as the media limits count them
        return math.ceil(self.seconds * self.fps - 1e-6)

    @property
    def label(self) -> str:
        return f"{self.width}x{self.height} {self.seconds:g} s"

    def num_tokens(self, max_pixels: int = 28 * 28 * 1280) -> int:
        """Video placeholder tokens with Qwen2.5-VL's processor (14 px patches, 2x2 merge)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(self.height, self.width, factor=28, min_pixels=56 * 56, max_pixels=max_pixels)
        return math.ceil(self.num_frames / 2) * (h // 28) * (w // 28)

    def pixel_bytes(self, max_pixels: int = 28 * 28 * 1280) -> int:
        """Bytes of the clip's raw uint8 patch rows (4 patches of 2 x 3 x 14 x 14 levels per token)."""
        return self.num_tokens(max_pixels) * 4 * 1176

    def server_limits(self) -> dict:
        """The server section's video limits that let this clip through."""
        return {"video_fps": self.fps, "max_video_frames": max(64, self.num_frames + 2),
                "max_video_seconds": max(120.0, self.seconds + 1)}

    def data_url(self) -> str:
        return mp4_data_url(self.seconds, width=self.width, height=self.height)


def context_for(clip: Clip) -> int:
    """A context that holds the clip's prompt (placeholders, template, answer)."""
    return 1 << max(10, (clip.num_tokens() + 256 - 1).bit_length())


def parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WIDTHxHEIGHT, e.g. 320x240") from None
    if width < 16 or height < 16 or width % 2 or height % 2:
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be even and at least 16")
    return width, height


def parse_clip(text: str) -> tuple[int, int, float]:
    try:
        width, height, seconds = text.lower().split("x")
        size, seconds = parse_size(f"{width}x{height}"), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WIDTHxHEIGHTxSECONDS, e.g. 640x480x8") from None
    if not 0.0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the seconds must be a positive number")
    return (*size, seconds)


def parse_clip_or_none(text: str) -> tuple[int, int, float] | None:
    return None if text.lower() == "none" else parse_clip(text)


def jpeg_data_url(width: int = 640, height: int = 480, seed: int = 0) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def mp4_data_url(seconds: float = 4.0, fps: int = 24, width: int = 320, height: int = 240) -> str:
    import av
    import numpy as np

    out = io.BytesIO()
    rng = np.random.default_rng(0)
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        base = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.roll(base, i * 4, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(out.getvalue()).decode()


def make_request(rid: str, kind: str, url: str):
    """A NewRequest asking to describe one image or video."""
    from mstar_actors.messages import ChatMessage, ContentPart, NewRequest, SamplingParams

    parts = [ContentPart(type="text", text=f"describe this {kind}"), ContentPart(type=f"{kind}_url", url=url)]
    return NewRequest(request_id=rid, model="vl", sampling=SamplingParams(), messages=[ChatMessage("user", parts)])


def video_body(url: str, stream: bool, model_name: str = "vl") -> dict:
    """A 2-token chat request carrying the video."""
    return {"model": model_name, "max_tokens": 2, "temperature": 0, "stream": stream, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "describe this video"},
                                                      {"type": "video_url", "video_url": {"url": url}}]}]}
