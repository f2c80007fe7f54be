"""Media input: find, fetch, bound and decode a request's images, videos and audio.

A chat message's ``image_url`` / ``video_url`` / ``audio_url`` content part
(``video_url`` and ``audio_url`` are vLLM's extensions) is one of the URLs
below; OpenAI's ``input_audio`` part (base64 data and a format) reaches here
as a data: URL (the frontend writes it so):

- ``data:<mime>;base64,<payload>``: decoded in memory, by ``pybase64``, which
  releases the GIL while it decodes (the standard library's ``binascii``
  holds it throughout, which stalls the other pool threads' drafts);
- ``http(s)://...``: fetched with aiohttp on the prepare actor's loop
  (``fetch_remote``): the whole fetch has a timeout, redirects are bounded,
  and the size limit is enforced while the body streams in, so an oversize
  body is cut off rather than read whole; every hop may reach only the
  addresses ``media_guard`` allows (by default public ones);
- ``file:///path``: read only inside ``server.allowed_media_dir``, after
  resolving symlinks, so ``..`` and links out of the folder are refused.

Decoding (``decode_image``, ``decode_video``, ``decode_audio``) is CPU work
and runs wherever the request is prepared (the pool's thread or inline).
Pillow reads an image's size from its header before decoding pixels, so an
oversize image (a decompression bomb: a small file that claims a huge canvas)
is refused before any pixel is decoded. A video's or an audio clip's duration
is checked from its container before decoding, and again while decoding
(counting what was decoded) when the container does not say or lies.

Every refusal is a ``MediaError`` naming the content part
(``messages[0].content[1].image_url``) and the limit it broke; the prepare
actor turns it into ``Failed(400, param=...)`` for that request alone. A
failed fetch (``FetchError``) tells the client only ``could not fetch
<part>`` and the limits a fetch keeps to, whatever the cause (no answer may
tell a closed port from a slow one); the cause goes to the server log.
"""

from __future__ import annotations

import binascii
import dataclasses
import io
import math
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pybase64

from mstar_actors.messages import ChatMessage, NewRequest

MEDIA_PART_TYPES = {"image_url": "image", "video_url": "video", "audio_url": "audio", "input_audio": "audio"}
VISION_KINDS, AUDIO_KINDS = ("image", "video"), ("audio",)


def part_names(kinds: Any, sep: str) -> str:
    """The chat content parts that carry media of ``kinds``, joined by ``sep`` (a refusal's words)."""
    return sep.join(part for part, kind in MEDIA_PART_TYPES.items() if kind in kinds)


_CHUNK_BYTES = 64 * 1024


class MediaError(ValueError):
    """A content part that cannot be served; ``param`` names it for the 400."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.reason = param, message


class Abandoned(Exception):
    """The request's client left while its media was prepared: the rest is not worth preparing."""


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_video_frames: int = 64
    max_video_seconds: float = 120.0
    max_video_pixels: int = 64 * 1920 * 1080
    max_items: int = 8
    video_fps: float = 2.0
    max_audio_seconds: float = 30.0
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    allowed_dir: str | None = None
    allowed_domains: tuple[str, ...] = ()  # http(s) hosts that may be fetched; empty: any (media_guard)
    allow_private_addresses: bool = False
    own_port: int = 0  # the server's port, never fetched (0: unknown)

    @classmethod
    def from_config(cls, server: Any) -> "MediaLimits":
        """From ``config.server`` (``ServerConfig``)."""
        return cls(
            max_bytes=server.max_media_bytes,
            max_image_pixels=server.max_image_pixels,
            max_video_frames=server.max_video_frames,
            max_video_seconds=server.max_video_seconds,
            max_video_pixels=server.max_video_pixels,
            max_items=server.max_media_items,
            video_fps=server.video_fps,
            max_audio_seconds=server.max_audio_seconds,
            fetch_timeout_s=server.media_fetch_timeout_s,
            max_redirects=server.max_media_redirects,
            allowed_dir=server.allowed_media_dir,
            allowed_domains=tuple(server.allowed_media_domains),
            allow_private_addresses=server.allow_private_media_addresses,
            own_port=server.port,
        )


@dataclass(frozen=True)
class MediaRef:
    """One media content part, in prompt order."""

    kind: str  # "image" | "video" | "audio"
    url: str
    param: str  # "messages[i].content[j].image_url" (or video_url, audio_url, input_audio)
    detail: str | None = None  # an image's "low": a version within LOW_DETAIL_SIZE square

    @property
    def scheme(self) -> str:
        # Look only at the head: splitting would copy the rest of the URL
        # (megabytes of base64 for a data: video) on the prepare actor's loop.
        # Accepted schemes are short; a longer one is refused like any other
        # unknown scheme.
        end = self.url.find(":", 0, 16)
        return self.url[:end].lower() if end >= 0 else ""


@dataclass(frozen=True)
class VideoFrames:
    frames: Any  # numpy uint8 array (num_frames, height, width, 3)
    fps: float  # the sampling rate the frames were taken at


# Freed bytes a process keeps per thread that drafts media at once
# (``keep_freed_buffers``): a draft of a 640x480 16 s clip peaks at ~100 MB.
KEPT_BYTES_PER_DRAFT = 256 << 20


def source_digest(data: bytes) -> bytes:
    """A media item's digest of its source bytes (blake2b, 16 bytes)."""
    import hashlib

    return hashlib.blake2b(data, digest_size=16).digest()  # releases the GIL on large buffers


def keep_freed_buffers(max_heap_block: int = 32 << 20, max_kept: int = KEPT_BYTES_PER_DRAFT) -> bool:
    """Let glibc's malloc serve blocks up to ``max_heap_block`` from one heap
    shared by every thread and keep up to ``max_kept`` freed bytes there, for
    a process that makes and drops media-sized buffers (a 4.2 MB body, its
    str, its encoded message; a draft's frames and patches) request after
    request. True when the allocator took all three settings; may be called
    again to change ``max_kept`` (the prepare actor scales it by its pool).

    Why: by default each such block is a fresh ``mmap`` whose pages fault in
    on first write and go back to the kernel on ``free``, so every body and
    draft pays its page faults again; kept blocks are reused without faults.
    One heap (M_ARENA_MAX 1), because pool threads would otherwise each get
    an arena of their own, mmap'ed heaps that hand big blocks to ``mmap``
    whatever the thresholds. The cost is resident memory: up to ``max_kept``
    freed bytes stay mapped. A no-op returning False where the C library has
    no ``mallopt`` (not glibc), or refuses the values."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # glibc's malloc.h
    return all([mallopt(m_arena_max, 1), mallopt(m_mmap_threshold, max_heap_block), mallopt(m_trim_threshold, max_kept)])


# --------------------------------------------------------------------------
# Finding the parts
# --------------------------------------------------------------------------


def collect_media(req: NewRequest, limits: MediaLimits, kinds: tuple[str, ...] | None = None) -> list[MediaRef]:
    """The request's media parts in prompt order; raises MediaError for a part
    of a kind not in ``kinds`` (None: any), an unsupported scheme or more
    parts than ``max_items``."""
    refs = list(_iter_media(req.messages or []))
    for ref in refs:
        if kinds is not None and ref.kind not in kinds:
            part = ref.param.rpartition(".")[2]
            accepted = part_names(kinds, ", ")
            raise MediaError(ref.param, f"this model takes no {ref.kind} ({part} parts); accepted media parts: {accepted}")
    if len(refs) > limits.max_items:
        raise MediaError(
            refs[limits.max_items].param,
            f"the request has {len(refs)} media parts; this server accepts at most "
            f"{limits.max_items} per request (server.max_media_items)",
        )
    for ref in refs:
        if ref.scheme not in ("data", "http", "https", "file"):
            raise MediaError(ref.param, "the url must be a data:, http(s):// or file:// URL")
    return refs


def _iter_media(chat: list[ChatMessage]):
    for i, message in enumerate(chat):
        if isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            kind = MEDIA_PART_TYPES.get(part.type)
            if kind is not None:
                yield MediaRef(kind, part.url or "", f"messages[{i}].content[{j}].{part.type}", part.detail)


# --------------------------------------------------------------------------
# Bytes: data:, file://, http(s)://
# --------------------------------------------------------------------------


def _too_big(ref: MediaRef, num_bytes: int | str, limits: MediaLimits) -> MediaError:
    return MediaError(
        ref.param, f"the {ref.kind} is {num_bytes} bytes; this server accepts at most "
        f"{limits.max_bytes} bytes per item (server.max_media_bytes)",
    )


def read_local(ref: MediaRef, limits: MediaLimits) -> bytes:
    """The bytes of a data: or file:// part (blocking: run it off the loop)."""
    if ref.scheme == "data":
        return _read_data_url(ref, limits)
    if ref.scheme == "file":
        return _read_file_url(ref, limits)
    raise MediaError(ref.param, f"{ref.scheme}: URLs are fetched, not read locally")


def _read_data_url(ref: MediaRef, limits: MediaLimits) -> bytes:
    url = ref.url
    comma = url.find(",")
    if comma < 0 or not url[:comma].lower().endswith(";base64"):
        raise MediaError(ref.param, "a data: URL must be base64: data:<mime type>;base64,<data>")
    num_chars = len(url) - comma - 1
    if num_chars * 3 // 4 > limits.max_bytes + 2:  # decoded size, known before decoding
        raise _too_big(ref, f"about {num_chars * 3 // 4}", limits)
    # an input_audio part's data is sent as base64 alone (its data: URL is ours): told of what the client sent
    what, offset = ("its data", comma + 1) if ref.param.endswith(".input_audio") else ("the data: URL", 0)
    try:
        text = url.encode("ascii")  # one copy; pybase64 reads the payload in place
    except UnicodeEncodeError as err:
        raise MediaError(ref.param, f"{what} is not valid base64: a non-ASCII character at position "
                                    f"{err.start - offset}") from None
    try:
        data = pybase64.b64decode(memoryview(text)[comma + 1:], validate=True)
    except (binascii.Error, ValueError):
        data = _lenient_base64(text[comma + 1:], ref.param, what)
    if len(data) > limits.max_bytes:
        raise _too_big(ref, len(data), limits)
    return data


_BASE64_SPACE = re.compile(rb"\s+")
_NOT_BASE64 = re.compile(rb"[^A-Za-z0-9+/=]")


def _lenient_base64(payload: bytes, param: str, what: str) -> bytes:
    """Lines broken where base64 tools wrap them (76 columns) joined, as Python's decoder joins them for vLLM,
    and a missing "=" padding restored (which vLLM refuses); else the first thing wrong in the client's words."""
    compact = _BASE64_SPACE.sub(b"", payload)
    if (bad := _NOT_BASE64.search(compact)) is None and len(compact) % 4 != 1:
        compact = compact.rstrip(b"=")
        try:
            return pybase64.b64decode(compact + b"=" * (-len(compact) % 4), validate=True)
        except (binascii.Error, ValueError):
            pass  # an "=" inside
    if bad is not None:
        char = bad[0].decode()
        problem = (f"{char!r} is no base64 character (URL-safe base64's - and _ are not read: send + and /)"
                   if char in "-_" else f"{char!r} is no base64 character (A-Z, a-z, 0-9, + and /, = at the end)")
    elif len(compact) % 4 == 1:
        problem = (f"its {len(compact)} characters are one more than a multiple of 4: the data is cut or has one "
                   "too many")
    else:
        problem = "an \"=\" stands before the end (padding ends the data)"
    raise MediaError(param, f"{what} is not valid base64: {problem}")


def _read_file_url(ref: MediaRef, limits: MediaLimits) -> bytes:
    if not limits.allowed_dir:
        raise MediaError(ref.param, "file:// URLs are off on this server (server.allowed_media_dir is not set)")
    parsed = urllib.parse.urlparse(ref.url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(ref.param, "a file:// URL must name a local path: file:///path/inside/the/allowed/dir")
    allowed = Path(limits.allowed_dir).resolve()
    try:  # resolve symlinks and '..' first, then check where it landed
        path = Path(urllib.parse.unquote(parsed.path)).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the path
        raise MediaError(ref.param, "no such file inside server.allowed_media_dir") from None
    if not path.is_relative_to(allowed) or not path.is_file():
        raise MediaError(ref.param, "the file is outside server.allowed_media_dir (or not a regular file)")
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise _too_big(ref, size, limits)
    return path.read_bytes()


class FetchError(MediaError):
    """An http(s) part that could not be fetched. ``str()`` is the detail, for
    the server log; the client is told only ``public()``, the same whatever
    went wrong, so answers cannot map what the server can reach, except where
    the client's own URL is refused before any connection or lookup (its
    scheme, a host not in ``server.allowed_media_domains``, an IP literal
    refused: ``is_public``), which tells it nothing it did not send, as vLLM
    names the allowed domains."""

    def __init__(self, param: str, message: str, is_public: bool = False):
        super().__init__(param, message)
        self.is_public = is_public

    def public(self) -> MediaError:
        if self.is_public:
            return MediaError(self.param, f"not fetched: {self.reason}")
        return FetchFailed(self.param)


class FetchFailed(MediaError):
    """What a client is told of any failed fetch: ``could not fetch <param>``,
    and what a fetch that succeeds is (the same words whatever the cause)."""

    def __init__(self, param: str):
        ValueError.__init__(self, f"could not fetch {param}; a fetch succeeds where the address answers 200 with "
                                  "the media within server.max_media_bytes and server.media_fetch_timeout_s, "
                                  "after at most server.max_media_redirects redirects (the server's log names "
                                  "the cause)")
        self.param = param


_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass
class FetchSession:
    """An aiohttp session whose connector resolves through ``GuardedResolver``,
    and the policy it enforces (``_follow`` checks IP literals against the
    same one). This host's addresses are read when it is made."""

    http: Any
    policy: Any  # media_guard.FetchPolicy

    async def close(self) -> None:
        await self.http.close()


def make_fetch_session(limits: MediaLimits, resolver: Any = None) -> FetchSession:
    """A session for ``fetch_remote``; ``resolver`` is the one the guard wraps
    (default: the system's). Call it on the loop that will use it."""
    import aiohttp

    from mstar_actors.prepare.media_guard import FetchPolicy, GuardedResolver

    policy = FetchPolicy.from_limits(limits)
    guarded = GuardedResolver(policy, resolver or aiohttp.ThreadedResolver())
    # No proxies from the environment, and no cookies carried from one client's fetch to another's.
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=guarded), trust_env=False,
                                 cookie_jar=aiohttp.DummyCookieJar())
    return FetchSession(http, policy)


async def fetch_remote(refs: list[MediaRef], limits: MediaLimits, session: FetchSession | None = None) -> dict[str, bytes]:
    """Fetch every http(s) part; returns ``param -> bytes``. Raises FetchError
    for the first part that fails (the request fails as a whole). ``session``
    None makes one for this call."""
    remote = [r for r in refs if r.scheme in ("http", "https")]
    if not remote:
        return {}
    own = session is None
    if own:
        session = make_fetch_session(limits)
    try:
        return {r.param: await _fetch_one(session, r, limits) for r in remote}
    finally:
        if own:
            await session.close()


async def _fetch_one(session: FetchSession, ref: MediaRef, limits: MediaLimits) -> bytes:
    import asyncio

    import aiohttp

    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            return await _follow(session, ref, limits)
    except FetchError:
        raise
    except MediaError as err:  # over a limit: still one answer for every failure
        raise FetchError(ref.param, str(err).removeprefix(f"{ref.param}: ")) from None
    except TimeoutError:
        raise FetchError(ref.param, f"fetching took over {limits.fetch_timeout_s} s (server.media_fetch_timeout_s)") from None
    except (aiohttp.ClientError, OSError, ValueError) as err:  # ValueError: a URL yarl cannot parse
        raise FetchError(ref.param, f"could not fetch the {ref.kind}: {_describe(err)}") from None


def _describe(err: Exception) -> str:
    """The error for the log, with a connector error's cause (its own text
    drops the guard's reason for refusing every address of a name)."""
    cause = getattr(err, "os_error", None)
    text = f"{type(err).__name__}: {err}"
    return f"{text} ({cause})" if cause is not None and str(cause) not in text else text


async def _follow(session: FetchSession, ref: MediaRef, limits: MediaLimits) -> bytes:
    """Follow up to ``max_redirects`` redirects by hand, each hop's URL checked
    by ``media_guard`` before it is requested (aiohttp's own following would
    check none); the next redirect past the limit is refused."""
    from yarl import URL

    from mstar_actors.prepare.media_guard import url_refusal

    url = URL(ref.url)
    blind = dataclasses.replace(session.policy, own_addresses=frozenset(), own_port=0)
    for hop in range(limits.max_redirects + 1):
        refusal = url_refusal(url.scheme, url.host, url.port, session.policy)
        if refusal is not None:
            # The client may read why its own URL (hop 0, not a redirect's) is refused, in the words of a policy
            # blind to this server's addresses and port: "an address of this server" would map them.
            said = url_refusal(url.scheme, url.host, url.port, blind) if hop == 0 else None
            if said is not None:
                raise FetchError(ref.param, f"{url.host}: {said}" if url.host else said, is_public=True)
            raise FetchError(ref.param, f"{url.host}: {refusal}" if url.host else refusal)
        async with session.http.get(url, allow_redirects=False) as resp:
            location = resp.headers.get("Location")
            if resp.status in _REDIRECTS and location:
                url = url.join(URL(location))
                continue
            if resp.status != 200:
                raise FetchError(ref.param, f"fetching the {ref.kind} gave HTTP {resp.status}; expected 200")
            if resp.content_length is not None and resp.content_length > limits.max_bytes:
                raise _too_big(ref, resp.content_length, limits)
            return await _read_bounded(resp, ref, limits)
    raise FetchError(ref.param, f"more than {limits.max_redirects} redirects (server.max_media_redirects)")


async def _read_bounded(resp: Any, ref: MediaRef, limits: MediaLimits) -> bytes:
    """The body, cut off as soon as it passes the limit (a lying or absent
    Content-Length cannot make us buffer more than ``max_bytes``)."""
    body = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK_BYTES):
        body += chunk
        if len(body) > limits.max_bytes:
            raise _too_big(ref, f"over {limits.max_bytes}", limits)
    return bytes(body)


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------


LOW_DETAIL_SIZE = 512  # OpenAI's "low" detail: the model sees a 512 x 512 version of the image


def _to_rgb(image: Any) -> Any:
    """RGB as the models' image processors make it (transformers'
    ``convert_to_rgb``, vLLM's loader for RGBA): transparent pixels over
    white, not their hidden colour."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(data: bytes, ref: MediaRef, limits: MediaLimits):
    """An RGB ``PIL.Image``; the pixel limit is checked from the header first.
    With ``detail: "low"``, shrunk (its aspect kept) to fit ``LOW_DETAIL_SIZE`` square."""
    from PIL import Image, UnidentifiedImageError

    # Pillow's own guard as a second line: it refuses past twice this at open(); ours is below.
    Image.MAX_IMAGE_PIXELS = limits.max_image_pixels
    try:
        image = Image.open(io.BytesIO(data))  # lazy: reads the header only
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise MediaError(
                ref.param, f"the image is {width}x{height} = {width * height} pixels; this server accepts "
                f"at most {limits.max_image_pixels} (server.max_image_pixels)",
            )
        image.load()
        image = _to_rgb(image)
        if ref.detail == "low":
            image.thumbnail((LOW_DETAIL_SIZE, LOW_DETAIL_SIZE))
        return image
    except MediaError:
        raise
    except Image.DecompressionBombError as err:  # Pillow's guard at open(), past twice the limit: it says the size
        size = re.search(r"\((\d+) pixels\)", str(err))
        count = size[1] if size else f"over {2 * limits.max_image_pixels}"
        raise MediaError(ref.param, f"the image has {count} pixels; this server accepts at most "
                                    f"{limits.max_image_pixels} (server.max_image_pixels)") from None
    except UnidentifiedImageError:
        raise MediaError(ref.param, "could not decode the image: not a format this server reads (PNG, JPEG, WebP, "
                                    "GIF, BMP, TIFF...)") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise MediaError(ref.param, f"could not decode the image: {type(err).__name__}: {err}") from None


def decode_video(data: bytes, ref: MediaRef, limits: MediaLimits, num_threads: int = 1,
                 abandoned: Callable[[], bool] = lambda: False) -> VideoFrames:
    """Frames sampled at ``limits.video_fps`` as a uint8 (T, H, W, 3) array.

    ``num_threads`` is ffmpeg's decoder threads for this one video: 1 (the
    default) decodes on the calling thread. The prepare pool is the
    parallelism: ffmpeg's automatic threading starts one frame thread per
    core for every decode, so N videos at once oversubscribe the host, and on
    a short clip its frame threads cost more CPU and wall time than they save.
    ``abandoned`` is asked at each decoded frame (``Abandoned``: a long clip
    of a client that left held its thread to its end)."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError(ref.param, "the file has no video stream")
            stream = container.streams.video[0]
            stream.codec_context.thread_count = num_threads
            if num_threads > 1:
                stream.thread_type = "AUTO"
            _check_duration(_duration_s(container, stream), stream.frames, ref, limits)
            frames = _sample_frames(container, stream, ref, limits, abandoned)
    except MediaError:
        raise
    except av.error.InvalidDataError:
        raise MediaError(ref.param, "could not decode the video: " + (
            "the file is empty" if not data else "its bytes are no container this server reads (MP4, WebM, "
                                                 "Matroska, AVI, MOV...), or are cut or damaged")) from None
    except (av.error.FFmpegError, OSError, ValueError) as err:
        reason = getattr(err, "strerror", None) or str(err)  # (ffmpeg's own words, without its errno and file)
        raise MediaError(ref.param, f"could not decode the video: {type(err).__name__}: {reason}") from None
    return VideoFrames(frames, limits.video_fps)


FRAME_LIST_PREFIX = "data:video/jpeg;base64,"  # vLLM's video as its frames: data:video/jpeg;base64,<jpeg>,<jpeg>...


def is_frame_list(ref: MediaRef) -> bool:
    """A video part sent as vLLM's list of JPEG frames (``FRAME_LIST_PREFIX``), not as a video file."""
    return ref.kind == "video" and ref.url[:len(FRAME_LIST_PREFIX)].lower() == FRAME_LIST_PREFIX


def decode_frame_list(ref: MediaRef, limits: MediaLimits) -> VideoFrames:
    """vLLM's ``data:video/jpeg;base64,<frame>,<frame>,...``: each frame an image (any format Pillow reads),
    all of one size, taken as sampled at ``limits.video_fps``; the video limits hold (frames, their pixels, the
    bytes of the part)."""
    import numpy as np

    pieces = ref.url[len(FRAME_LIST_PREFIX):].split(",")
    if len(pieces) > limits.max_video_frames:
        raise MediaError(ref.param, f"the video is {len(pieces)} frames; this server accepts at most "
                                    f"{limits.max_video_frames} (server.max_video_frames)")
    frames, size, num_bytes = [], None, 0
    for i, piece in enumerate(pieces):
        where = MediaRef("image", "data:image/jpeg;base64," + piece, ref.param)
        try:
            data = _read_data_url(where, limits)
        except MediaError as err:  # the part is the field (its param); the frame is in the words
            raise MediaError(ref.param, f"frame {i}: {err.reason}") from None
        num_bytes += len(data)
        if num_bytes > limits.max_bytes:
            raise _too_big(ref, f"over {num_bytes}", limits)
        try:
            image = decode_image(data, where, limits)
        except MediaError as err:
            raise MediaError(ref.param, f"frame {i}: {err.reason}") from None
        if size is None:
            size = image.size
            if len(pieces) * size[0] * size[1] > limits.max_video_pixels:
                raise MediaError(ref.param, f"the video's {len(pieces)} frames of {size[0]}x{size[1]} hold over "
                                            f"{limits.max_video_pixels} pixels (server.max_video_pixels)")
        elif image.size != size:
            raise MediaError(ref.param, f"frame {i} is {image.size[0]}x{image.size[1]}, frame 0 {size[0]}x{size[1]}: "
                                        "a video's frames are of one size")
        frames.append(np.asarray(image, dtype=np.uint8))
    return VideoFrames(np.stack(frames), limits.video_fps)


def _duration_s(container: Any, stream: Any) -> float | None:
    """The stream's length as the container states it. A container's figure
    may count from 0 rather than from its first timestamp (Matroska cut from
    a stream): that start is taken off, and where it was not counted the
    figure is short, which the frame-by-frame check while decoding makes up."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return max(0, container.duration - max(0, container.start_time or 0)) / 1_000_000  # av.time_base
    return None


def _check_duration(seconds: float | None, stream_frames: int, ref: MediaRef, limits: MediaLimits) -> None:
    """The container's length against the limits before any frame is
    decoded; the frames sampled are one per 1/fps seconds, and no more than
    the stream has (``stream_frames``, 0 where the container does not say:
    a clip slower than the sampling rate gives each of its frames once)."""
    if seconds is None:
        return  # checked frame by frame while decoding
    if seconds > limits.max_video_seconds:
        raise MediaError(ref.param, f"the video is {seconds:.1f} s long; this server accepts at most "
                                    f"{limits.max_video_seconds} s (server.max_video_seconds)")
    num_frames = math.ceil(seconds * limits.video_fps - 1e-6)
    if stream_frames > 0:
        num_frames = min(num_frames, stream_frames)
    if num_frames > limits.max_video_frames:
        raise _too_many_frames(ref, num_frames, limits)


def _too_many_frames(ref: MediaRef, num_frames: int | str, limits: MediaLimits) -> MediaError:
    return MediaError(
        ref.param, f"the video gives {num_frames} frames at {limits.video_fps} fps; this server accepts "
        f"at most {limits.max_video_frames} (server.max_video_frames; fewer fps: server.video_fps)",
    )


def _sample_frames(container: Any, stream: Any, ref: MediaRef, limits: MediaLimits,
                   abandoned: Callable[[], bool]) -> Any:
    """One frame per 1/fps seconds (the first frame at or after each sample
    time, counted from the first frame's: a clip whose timestamps start past 0
    is sampled as the same clip from 0; a gap's sample times without a frame
    of their own are skipped) as a uint8 (T, H, W, 3) array, each written into one buffer as it
    is decoded: no list of frames and stacked copy of it, and a video whose
    sampled frames would hold more than ``max_video_pixels`` is refused at
    the frame that passes it (a small file of large flat frames decodes to
    gigabytes)."""
    import torch

    buffer, num = None, 0
    next_t, start = 0.0, None
    for frame in container.decode(stream):
        if abandoned():
            raise Abandoned()
        t = frame.time if frame.time is not None else num / limits.video_fps
        start = t if start is None else start
        t -= start
        if t > limits.max_video_seconds:
            raise MediaError(ref.param, f"the video runs past {limits.max_video_seconds} s (server.max_video_seconds)")
        if t + 1e-6 < next_t:
            continue
        pixels = frame.width * frame.height
        if pixels > limits.max_image_pixels:
            raise MediaError(ref.param, f"video frames are {frame.width}x{frame.height}; this server accepts at "
                                        f"most {limits.max_image_pixels} pixels (server.max_image_pixels)")
        if num == limits.max_video_frames:
            raise _too_many_frames(ref, f"over {limits.max_video_frames}", limits)
        if (num + 1) * pixels > limits.max_video_pixels:
            raise MediaError(ref.param, f"the video's sampled frames hold over {limits.max_video_pixels} pixels "
                                        f"({num + 1} frames of {frame.width}x{frame.height} so far); this server "
                                        f"accepts at most that (server.max_video_pixels): send a shorter or smaller "
                                        f"video")
        if buffer is None:  # pages are committed as frames land in them
            cap = min(limits.max_video_frames, limits.max_video_pixels // pixels)
            buffer = torch.empty((cap, frame.height, frame.width, 3), dtype=torch.uint8)
        elif buffer.shape[1:3] != (frame.height, frame.width):
            raise MediaError(ref.param, f"the video's frame size changes from {buffer.shape[2]}x{buffer.shape[1]} "
                                        f"to {frame.width}x{frame.height}; send a video of one frame size")
        # torch's copy releases the GIL for the frame's MBs, numpy's would not
        buffer[num].copy_(torch.from_numpy(frame.to_ndarray(format="rgb24")))
        num += 1
        next_t += 1.0 / limits.video_fps
        while next_t <= t + 1e-6:  # a gap in the stream: this frame was each missed time's, no burst after it
            next_t += 1.0 / limits.video_fps
    if buffer is None:
        raise MediaError(ref.param, "the video has no frames")
    return buffer[:num].numpy()


_AUDIO_PROBE = {"probesize": "32768"}


def decode_audio(data: bytes, ref: MediaRef, limits: MediaLimits, sampling_rate: int,
                 max_seconds: float | None = None) -> Any:
    """The clip as float32 mono samples at ``sampling_rate`` (a numpy array):
    downmixed by the mean (as audio loaders for these models do), then
    resampled by ffmpeg (``_resampled``). ``max_seconds`` (default
    ``limits.max_audio_seconds``) is checked from the container first, then
    by counting decoded samples, so a file that lies about its length is cut
    off as soon as it passes the limit."""
    import av
    import numpy as np

    max_seconds = limits.max_audio_seconds if max_seconds is None else max_seconds
    try:
        # A short probe: audio headers state the stream's parameters, and
        # ffmpeg's default 5 MB probe of a wav (read through Python, GIL held)
        # costs more than decoding the whole clip.
        with av.open(io.BytesIO(data), mode="r", options=_AUDIO_PROBE) as container:
            if not container.streams.audio:
                raise MediaError(ref.param, "the file has no audio stream")
            stream = container.streams.audio[0]
            seconds = _duration_s(container, stream)
            if seconds is not None and seconds > max_seconds + 1e-3:
                raise _too_long(ref, _over(seconds, max_seconds), max_seconds)
            chunks = _resampled(container, stream, ref, sampling_rate, int(max_seconds * sampling_rate) + 1)
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as err:
        raise MediaError(ref.param, f"could not decode the audio: {type(err).__name__}: {err}") from None
    if not chunks:
        raise MediaError(ref.param, "the audio has no samples")
    samples = np.concatenate(chunks, axis=1).mean(axis=0, dtype=np.float32)
    if not np.isfinite(samples).all():  # (a float file's NaN: the features, and every reply, would be NaN too)
        raise MediaError(ref.param, "the audio holds samples that are no finite numbers (NaN or infinity); send "
                                    "a clip of real samples")
    return samples


def _resampled(container: Any, stream: Any, ref: MediaRef, sampling_rate: int, max_samples: int) -> list:
    """The clip resampled to planar float32 at ``sampling_rate``: [channels, n]
    arrays. Frames are decoded one by one (their samples counted against the
    limit as they come), then joined in a FIFO, downmixed by the mean and
    resampled in one call: resampling frame by frame is a Python loop of
    small calls that holds the GIL, which kept the prepare pool's threads
    from running clips side by side, and resampling one channel instead of
    each halves the filter's work on stereo (the filter is linear: the mean
    of the resampled channels is the resampled mean, to rounding; audio
    loaders such as librosa's downmix first too). A stream whose frames
    change format or rate is resampled frame by frame, every channel."""
    import av
    import numpy as np

    frames = []
    num_in = 0
    for frame in container.decode(stream):
        frames.append(frame)
        num_in += frame.samples
        if num_in * sampling_rate > max_samples * frame.sample_rate:
            raise _too_long(ref, f"over {(max_samples - 1) / sampling_rate:g}", (max_samples - 1) / sampling_rate)
    if not frames:
        return []
    first = frames[0]
    kind = (first.format.name, first.layout.name, first.sample_rate)
    if all((f.format.name, f.layout.name, f.sample_rate) == kind for f in frames):
        fifo = av.AudioFifo()
        for f in frames:
            f.pts = None  # the FIFO checks timestamps for gaps; a clip's are the decoder's, not ours to judge
            fifo.write(f)
        # To planar float32 at the stream's own rate (a conversion, no filter), then the mean of the channels.
        planar = av.AudioResampler(format="fltp", layout=kind[1], rate=kind[2]).resample(fifo.read())
        mono = np.concatenate([out.to_ndarray() for out in planar], axis=1).mean(axis=0, dtype=np.float32)
        whole = av.AudioFrame.from_ndarray(mono[None, :], format="fltp", layout="mono")
        whole.sample_rate = kind[2]
        frames = [whole]
    resampler = av.AudioResampler(format="fltp", rate=sampling_rate)
    chunks = [out.to_ndarray() for frame in [*frames, None] for out in resampler.resample(frame)]
    if sum(chunk.shape[1] for chunk in chunks) > max_samples:
        raise _too_long(ref, f"over {(max_samples - 1) / sampling_rate:g}", (max_samples - 1) / sampling_rate)
    return chunks


def _over(seconds: float, limit: float) -> str:
    """``seconds`` written with the decimals that show it past ``limit`` (2.005 against 2: not "2.00")."""
    for digits in range(2, 7):
        if round(seconds, digits) > limit:
            return f"{seconds:.{digits}f}"
    return f"over {limit:g}"


def _too_long(ref: MediaRef, seconds: str, limit: float) -> MediaError:
    return MediaError(ref.param, f"the audio is {seconds} s long; this server accepts at most {limit:g} s per clip "
                                 "(server.max_audio_seconds, and the model's feature extractor's chunk_length)")
