"""Preparation throughput of image and video requests through the prepare
actor's pool, with 1, 2, 4 and 8 workers.

    python tools/bench_prepare.py [--requests 32] [--workers 1 2 4 8] [--torch-threads 1]

The requests go through ``PrepareActor`` over in-memory channels, with the
real Qwen2.5-VL preparation (chat template, Pillow / ``av`` decode,
transformers' Qwen2-VL image processor, the video patch layout) on a folder
this script saves itself: a Qwen2.5-VL ``config.json``, a word-level
tokenizer with Qwen's vision tokens, and the processor's config. No model
weights are needed to prepare. Media travel as data: URLs (a 640x480 JPEG; a
4 s 320x240 mpeg4 clip at 24 fps, sampled at 2 fps), so no network is timed.
Tensors go to an in-process stand-in for the arena. The video rows come
twice: the 4 s clip, and ``--ttft-clip`` (640x480 16 s: a draft ~10x
longer, the seed's regime), half as many requests a batch. Every row is
measured twice in the same interleaved rounds: through the actor (1 worker
is the inline path) and on a bare thread pool of as many threads pinned the
same way (``PlainPool``: how the seed measured its 1.9x / 2.9x, stage by
stage on N threads against one; against the actor's rows it shows what the
actor's loop costs). Each cell also shows the process's CPU time per request (CPU ms/req rising with the workers is
contention; flat CPU with a flat speed-up is a serial part: the GIL or the
actor's loop), the share of the batch its threads spent drafting, and the
drafts' CPU over their wall time; the speed-up is the median of each
round's ratio to the 1-worker rate of that round, the rate counted in
the batch's steady middle (its first wave and its drain left out; a second
speed-up, "whole batch", keeps them). A GIL probe follows: how
long one video draft holds the GIL.

Then, in the same run, time to first token at concurrency 4 for video
requests over HTTP: the real server (``python -m mstar_actors serve``) with
``prepare.preprocess_workers`` 4 (the pool) against 1 (inline), on a tiny
random Qwen2.5-VL this script saves (``--model PATH`` serves a real folder),
each request streamed and timed to its first content chunk, in two
workloads: bursts of 4 sent at once (``--ttft-rounds`` of them), then a
closed loop of 4 clients that each send their next request as soon as their
last one has answered (``--ttft-rounds`` requests each over two runs, not
counting a ramp-up request per run), which is what serving benchmarks call concurrency 4
(``--max-concurrency``) and how the seed measured it. Both servers run side
by side and take turns (bursts alternate; the closed loop runs twice per
server, pool, inline, inline, pool), so the host's drift hits both alike. The ratio
inline / pool is printed for both, with each stage of the requests' way (from the
prepare actor's DEBUG stage lines and the worker's step lines): when the
frontend had the body, when prepare read it, drafted it and sent it, and the
prefill steps that followed. TTFT is measured for the default clip, then
for ``--ttft-clip`` (default 640x480x16: 32 frames, a draft of 250-600 ms on
one core by host, the seed's regime, where it measured TTFT halved; ``none`` skips
it), then for ``--ttft-extra-clip`` if given; a last table gives inline /
pool per clip. ``--ttft-rounds 0`` skips TTFT. Before TTFT, the frontend's part alone
(``--frontend-rounds``, ``frontend_path``): four ``--ttft-clip`` bodies at once through the real
frontend and a ring to a prepare stand-in. ``--drafts-only`` runs just the draft figures (alone
against four at once: CPU, page faults, GIL waits) and that frontend part. With ``OUT`` set
in the environment, the tables are also appended to ``$OUT/bench_prepare.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import io
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    save_word_tokenizer(folder, vocab)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(folder)
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "vocab_size": 512, "image_token_id": IMAGE_TOKEN, "video_token_id": VIDEO_TOKEN,
              "bos_token_id": 1, "eos_token_id": 2,
              "text_config": {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def vl_prepare_info(folder: Path) -> Any:
    """The launcher's facts for a ``save_vl_prepare_folder`` folder, stated here:
    it holds no decoder for ``load_model_info`` to read, and preparation needs none."""
    from mstar_actors.model_info import ModelInfo

    return ModelInfo(served_name="vl", model_dir=str(folder), architecture="Qwen2_5_VLForConditionalGeneration",
                     vocab_size=512, eos_token_ids=(2,), dtype="float32", max_model_len=1 << 20, is_multimodal=True,
                     media_token_ids={"image": IMAGE_TOKEN, "video": VIDEO_TOKEN})


def save_word_tokenizer(folder: Path, vocab: dict[str, int]) -> None:
    """A word-level tokenizer over ``vocab`` with Qwen's chat template and specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


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

    sys.path.insert(0, str(ROOT / "tests"))
    from models import vl_factories as vf

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
    save_word_tokenizer(folder, vocab)
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

    from models.factories import _spread_weights

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
    shared segment. A fresh 7.5 MB allocation per request (``clone``) cost
    ~3 ms of page faults on the loop's thread, which the server never pays and
    which slowed the 1-worker baseline most. The buffer is a ring: once it
    wraps, the oldest entries of ``tensors`` are overwritten (their shapes stay);
    a tensor bigger than the buffer replaces it with one twice its size."""

    def __init__(self, capacity_bytes: int = 64 << 20):
        import torch

        self.buffer = torch.empty(capacity_bytes, dtype=torch.uint8).zero_()
        self.tensors: dict[int, object] = {}
        self._offset = 0

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
    from mstar_actors.messages import ChatMessage, ContentPart, NewRequest, SamplingParams

    parts = [ContentPart(type="text", text=f"describe this {kind}"), ContentPart(type=f"{kind}_url", url=url)]
    return NewRequest(request_id=rid, model="vl", sampling=SamplingParams(), messages=[ChatMessage("user", parts)])


class ActorUnderTest:
    """A ``PrepareActor`` over in-memory channels with ``num_workers`` pool
    threads, kept running between batches as a server keeps it: its threads
    persist, so a batch after ``warm_up`` finds every thread warm (a fresh
    pool's first draft on each thread pays its thread's one-time costs, which
    with 8 workers and a few requests per thread weighed on the 8-worker
    cell only)."""

    def __init__(self, preparer, num_workers: int, pin: bool = True):
        from actors.prepare import PrepareActor
        from mstar_actors.config import Config, PrepareConfig
        from mstar_actors.messages import FrontendToPrepare, PrepareToConductor
        from transport.memory import MemoryChannel

        self.num_workers = num_workers
        self.inbox = MemoryChannel(FrontendToPrepare, "frontend.prepare", capacity_bytes=64 << 20)
        self.out = MemoryChannel(PrepareToConductor, "prepare.conductor", capacity_bytes=16 << 20)
        config = Config(prepare=PrepareConfig(pin_pool_threads=pin))
        self.actor = PrepareActor(name="prepare", config=config, inbox={"frontend": self.inbox},
                                  outbox={"conductor": self.out}, preparer=preparer, arena=HeapArena(),
                                  num_workers=num_workers)
        self.task = asyncio.create_task(self.actor.run())
        # Each released request's draft (wall s, its thread's CPU s): against
        # the batch's time they split a pool's shortfall into idle threads
        # and drafts slowed by one another.
        self.drafts: list[tuple[float, float]] = []
        send = self.actor._send_result

        async def kept(slot, result) -> None:
            self.drafts.append((slot.draft_end - slot.draft_start, slot.draft_cpu_ms / 1e3))
            await send(slot, result)

        self.actor._send_result = kept

    async def warm_up(self, make) -> None:
        """Two requests per thread, all at once (every thread drafts at least one)."""
        await self.batch([make(f"warm{self.num_workers}-{i}") for i in range(2 * self.num_workers)])

    async def batch(self, requests: list) -> list[float]:
        """Seconds from the first request sent to each Prepared received, in order."""
        from mstar_actors.messages import Failed

        self.drafts.clear()
        start = time.perf_counter()
        sender = asyncio.create_task(_send_all(self.inbox, requests))
        done = []
        for _ in requests:
            msg = await self.out.recv()
            done.append(time.perf_counter() - start)
            if isinstance(msg, Failed):
                raise RuntimeError(f"request {msg.request_id} failed: {msg.message}")
        await sender
        return done

    async def close(self) -> None:
        from mstar_actors.messages import Shutdown

        await self.inbox.send(Shutdown(reason="bench"))
        await self.task


class PlainPool:
    """The same drafts on a bare ``ThreadPoolExecutor`` of ``num_workers``
    threads, pinned as the prepare pool pins its own (``pool_pins``), with no
    actor around them: no mailbox, no release, no arena, no loop sharing the
    GIL. This is how the seed measured its 1.9x / 2.9x (each stage's
    throughput on N threads against one), so its rows show what the drafts
    themselves allow and, against the actor's rows, what the actor costs.
    Same interface as ``ActorUnderTest`` for the throughput table."""

    def __init__(self, preparer, num_workers: int, pin: bool = True):
        import concurrent.futures
        import itertools
        import threading

        self.num_workers = num_workers
        self.preparer = preparer
        self.drafts: list[tuple[float, float]] = []
        pins = pool_pins(num_workers) if pin else None
        taken = itertools.count()

        def pin_thread() -> None:
            if pins:
                os.sched_setaffinity(threading.get_native_id(), pins[next(taken) % len(pins)])

        self.pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="plain",
                                                          initializer=pin_thread)

    def _draft(self, req) -> tuple[float, float]:
        from mstar_actors.messages import Failed

        start, cpu = time.perf_counter(), time.thread_time()
        result = self.preparer.draft(req, {})
        if isinstance(result, Failed):
            raise RuntimeError(f"request {result.request_id} failed: {result.message}")
        return time.perf_counter() - start, time.thread_time() - cpu

    async def warm_up(self, make) -> None:
        await self.batch([make(f"warm-plain{self.num_workers}-{i}") for i in range(2 * self.num_workers)])

    async def batch(self, requests: list) -> list[float]:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        done = []

        async def one(req) -> tuple[float, float]:
            timing = await loop.run_in_executor(self.pool, self._draft, req)
            done.append(time.perf_counter() - start)
            return timing

        self.drafts = await asyncio.gather(*(one(r) for r in requests))
        return sorted(done)

    async def close(self) -> None:
        self.pool.shutdown()


async def _send_all(inbox, requests) -> None:
    for req in requests:
        await inbox.send(req)


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

    def num_tokens(self, max_pixels: int = 28 * 28 * 1280) -> int:
        """Video placeholder tokens with Qwen2.5-VL's processor (14 px patches, 2x2 merge)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(self.height, self.width, factor=28, min_pixels=56 * 56, max_pixels=max_pixels)
        return math.ceil(self.num_frames / 2) * (h // 28) * (w // 28)

    def pixel_bytes(self, max_pixels: int = 28 * 28 * 1280) -> int:
        """Bytes of the clip's raw uint8 patch rows (4 patches of 2 x 3 x 14 x 14 levels per token)."""
        return self.num_tokens(max_pixels) * 4 * 1176

    def media_limits(self) -> str:
        """The server section's video limits that let this clip through."""
        return (f"video_fps: {self.fps}, max_video_frames: {max(64, self.num_frames + 2)}, "
                f"max_video_seconds: {max(120.0, self.seconds + 1)}")


def context_for(clip: Clip) -> int:
    """A context that holds the clip's prompt (placeholders, template, answer)."""
    return 1 << max(10, (clip.num_tokens() + 256 - 1).bit_length())


def serve_for_ttft(model_dir: Path, num_workers: int, tmp: Path, clip: Clip = Clip(), model_name: str = "vl",
                   max_model_len: int | None = None, concurrency: int = 4, pin: bool = True):
    """Start the server with ``num_workers`` prepare threads; (process, port, ServerLog) once serving.

    ``max_model_len`` also sizes the batch budget: ``concurrency`` whole video
    prompts fit one step. With a budget of one context (1,024 for the default
    clip, 406 tokens a prompt) only two of four prompts fit a step, so the
    scheduler serialises what the pool prepared at once. Prefix caching is
    off: every request carries the same clip, and with the cache on each
    prompt after the first computes only its last block, so TTFT would time
    no prefill (and no vision encode) at all, as no real client sees.

    The server logs at DEBUG (``MSTAR_BENCH_SERVER_LOG`` sets another level):
    the prepare actor's per-request stage line and the worker's step line are
    what ``ServerLog`` keeps to split TTFT into its stages."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = tmp / f"ttft-{num_workers}.yaml"
    config.write_text(
        f"model: {{path: {model_dir}, name: {model_name}, dtype: auto, device: auto}}\n"
        f"prepare: {{preprocess_workers: {num_workers}, pin_pool_threads: {str(pin).lower()}}}\n"
        f"server: {{max_body_bytes: 67108864, max_media_bytes: 52428800, {clip.media_limits()}}}\n"
        + (f"scheduler: {{max_model_len: {max_model_len}, max_num_batched_tokens: {concurrency * max_model_len}}}\n"
           if max_model_len else "")
        # Two servers share the device (measure_ttft runs pool and inline side by side): each
        # takes the blocks its concurrent prompts need, or a share of free memory.
        + (f"kv: {{enable_prefix_caching: false, num_blocks: {concurrency * -(-max_model_len // 16) + 64}}}\n"
           if max_model_len else "kv: {enable_prefix_caching: false, memory_fraction: 0.4}\n")
        +
        f"transport: {{arena_bytes: {arena_bytes(clip, concurrency)}, ring_bytes: {ring_bytes(clip)}}}\n"
    )
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "mstar_actors", "serve", str(config), "--port", str(port),
                             "--log-level", os.environ.get("MSTAR_BENCH_SERVER_LOG", "DEBUG")],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen: list[str] = []
    for line in proc.stderr:  # the launcher logs "serving NAME at http://..." once every actor is ready
        seen.append(line)
        if f"serving {model_name} at http://" in line:
            break
    else:
        tail = "".join(seen[-30:])
        raise RuntimeError(f"the server with preprocess_workers={num_workers} exited before serving; its log ends:\n{tail}")
    log = ServerLog(echo=os.environ.get("MSTAR_BENCH_SERVER_LOG") == "DEBUG")  # echo: show the step log lines
    log.drain(proc.stderr)
    return proc, port, log


def ring_bytes(clip: Clip) -> int:
    """Rings that take the clip's NewRequest: its data: URL is ~1.4 x the mp4
    (4.2 MB for 640x480 16 s, over the 4 MiB default), twice over, in whole MiB."""
    url_bytes = len(mp4_data_url(clip.seconds, width=clip.width, height=clip.height))
    return max(4 << 20, -(-2 * (url_bytes + (64 << 10)) // (1 << 20)) << 20)


def arena_bytes(clip: Clip, concurrency: int) -> int:
    """Room for every concurrent request's pixels twice over (256 MiB at least), in whole MiB."""
    return max(256 << 20, -(-2 * concurrency * clip.pixel_bytes() // (1 << 20)) << 20)


class Stage(NamedTuple):
    """One request through the prepare actor, ms after its arrival at the frontend."""

    arrival: float  # time.time() at the frontend
    read: float
    draft_start: float
    draft_end: float
    release_start: float  # done and at the head of the arrival order
    stored: float  # its tensors in the arena
    sent: float
    draft_cpu: float  # the drafting thread's own CPU ms
    draft_faults: float  # and its minor page faults


class Step(NamedTuple):
    at: float  # time.time() when the worker logged it (the step's end; ms resolution)
    num_tokens: int
    num_new: int
    ms: float


_STAGE = re.compile(r"prepared (\S+) at (\S+): read (\S+), draft (\S+)-(\S+), release (\S+)-(\S+), "
                    r"sent (\S+) ms after arrival; "
                    r"draft CPU (\S+) ms, (\d+) faults")
_STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*step \d+: \d+ rows, (\d+) tokens, (\d+) new, (\S+) ms")


class ServerLog:
    """The server's stderr, read on a thread (which also keeps the pipe
    drained): the prepare actor's stage line per request (see
    ``actors/prepare.py`` ``stage_line``) and the worker's step lines."""

    def __init__(self, echo: bool = False):
        self.echo = echo
        self.stages: dict[str, Stage] = {}
        self.steps: list[Step] = []

    def drain(self, stream) -> None:
        import threading

        threading.Thread(target=lambda: [self.read_line(line) for line in stream], daemon=True).start()

    def read_line(self, line: str) -> None:
        if (m := _STAGE.search(line)) is not None:
            self.stages[m[1]] = Stage(*(float(x) for x in m.groups()[1:]))
        elif (m := _STEP.search(line)) is not None:
            import datetime

            at = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            self.steps.append(Step(at, int(m[2]), int(m[3]), float(m[4])))
            if self.echo:
                print(line, end="", file=sys.stderr)


async def check_one(port: int, url: str, model_name: str = "vl") -> int:
    """One unstreamed video request must answer 200 with its 2 tokens; returns its prompt tokens."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                json=_video_body(url, False, model_name)) as response:
            if response.status != 200:
                raise RuntimeError(f"the check request answered {response.status}: {await response.text()}")
            usage = (await response.json())["usage"]
    if usage["completion_tokens"] != 2:
        raise RuntimeError(f"the check request made {usage['completion_tokens']} tokens, asked for 2")
    return usage["prompt_tokens"]


class Timed(NamedTuple):
    """One streamed request as the client saw it."""

    request_id: str  # the engine's id: the chunk's id and choice 0
    sent: float  # time.time() when the client sent it
    ttft: float  # seconds to the first content chunk


def _encoded_video_body(url: str, model_name: str = "vl") -> tuple[bytes, dict]:
    """The streamed request's body and headers, encoded once before any clock
    starts: ``json=body`` serialised the 0.5-7 MB body in each request on the
    client's one loop (~6 ms per 2.2 MB on the 2-core VM), so the fourth
    request's "TTFT" held three other requests' client-side encoding, which no
    server change can remove."""
    return json.dumps(_video_body(url, True, model_name)).encode(), {"Content-Type": "application/json"}


async def _timed(session, port: int, raw: bytes, headers: dict) -> Timed:
    """One streamed request, timed to its first chunk and read to its end."""
    sent, start = time.time(), time.perf_counter()
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=raw, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"video request answered {response.status}: {await response.text()}")
        first = None
        async for line in response.content:
            if first is None and line.startswith(b"data: "):
                first = Timed(json.loads(line[6:])["id"] + "-0", sent, time.perf_counter() - start)
    return first


async def ttft_round(port: int, url: str, concurrency: int, model_name: str = "vl") -> list[Timed]:
    """A burst: ``concurrency`` video requests sent at once, each timed to its first streamed chunk.

    Plain aiohttp, so the benchmark runs where the ``openai`` client is not installed."""
    import aiohttp

    raw, headers = _encoded_video_body(url, model_name)
    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(_timed(session, port, raw, headers) for _ in range(concurrency))))


async def closed_loop(port: int, url: str, concurrency: int, per_client: int,
                      model_name: str = "vl") -> tuple[list[Timed], float]:
    """Concurrency as serving benchmarks mean it (``--max-concurrency``, the
    seed's "V2T c=4"): ``concurrency`` clients, each sending its next video
    request as soon as its last one has answered, so that many are in flight
    at all times. Each client sends ``per_client`` + 1; its first (all sent
    at once: the ramp-up, a burst) is not counted. Returns the counted
    requests and the seconds from the first counted one sent to the last
    answered."""
    import aiohttp

    raw, headers = _encoded_video_body(url, model_name)
    counted: list[tuple[Timed, float]] = []

    async def client(session) -> None:
        await _timed(session, port, raw, headers)
        for _ in range(per_client):
            counted.append((await _timed(session, port, raw, headers), time.time()))

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    span = max(done for _, done in counted) - min(t.sent for t, _ in counted)
    return [t for t, _ in counted], span


class TtftRun(NamedTuple):
    """One server's measured requests: bursts, then a closed loop."""

    burst: list[Timed]  # ``rounds`` bursts of ``concurrency`` sent at once
    closed: list[Timed]  # the closed loop's counted requests
    closed_span: float  # seconds they spanned
    log: ServerLog


def measure_ttft(model_dir: Path, url: str, tmp: Path, rounds: int, clip: Clip, concurrency: int = 4,
                 max_model_len: int | None = None, pin: bool = True) -> tuple[dict[int, TtftRun], int]:
    """TTFT at ``concurrency`` with the pool (4 workers) and inline (1): both
    servers run side by side (each idle while the other is measured), taking
    turns, so a change in the host's speed hits both alike (on the 16-core
    host the same inline draft took 270 ms in one minute and 390 in the
    next). ``rounds`` bursts each, alternating, then the closed loop twice
    per server, pool, inline, inline, pool (a linear drift cancels), with
    ``rounds`` // 2 requests per client each time. Returns each server's requests and log, and
    the video prompt's token count."""
    import signal

    servers = {}
    try:
        for num_workers in (4, 1):
            progress(f"TTFT: starting the server with preprocess_workers={num_workers}")
            servers[num_workers] = serve_for_ttft(model_dir, num_workers, tmp, clip, max_model_len=max_model_len,
                                                  concurrency=concurrency, pin=pin)
        bursts: dict[int, list[Timed]] = {n: [] for n in servers}
        closed: dict[int, list[Timed]] = {n: [] for n in servers}
        spans = dict.fromkeys(servers, 0.0)
        for _, port, _ in servers.values():
            num_prompt_tokens = asyncio.run(check_one(port, url))  # also the warm-up of every actor
            asyncio.run(ttft_round(port, url, concurrency))  # and of every pool thread (first-call costs)
        for i in range(rounds):
            for n, (_, port, _) in servers.items():
                bursts[n] += asyncio.run(ttft_round(port, url, concurrency))
            progress(f"TTFT: burst {i + 1}/{rounds}", end="\r")
        per_half = max(1, rounds // 2)
        for n in (4, 1, 1, 4):
            progress(f"TTFT: closed loop, preprocess_workers={n}, {concurrency} x {per_half} requests", end="\r")
            timed, span = asyncio.run(closed_loop(servers[n][1], url, concurrency, per_half))
            closed[n] += timed
            spans[n] += span
        progress("")
    finally:
        for proc, _, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _, _ in servers.values():
            proc.wait(60)
    return {n: TtftRun(bursts[n], closed[n], spans[n], servers[n][2]) for n in servers}, num_prompt_tokens


def ttft_stages(timed: list[Timed], log: ServerLog, num_rounds: int) -> dict[str, float]:
    """p50 over the requests of each stage, in ms after the client sent the
    request, and of the draft's own duration; plus the prefill steps that ran
    while the requests waited for their first token."""
    import statistics

    rows: dict[str, list[float]] = collections.defaultdict(list)
    for t in timed:
        stage = log.stages.get(t.request_id)
        rows["first token at the client (TTFT)"].append(1e3 * t.ttft)
        if stage is None:
            continue  # the server logs at another level than DEBUG
        base = 1e3 * (stage.arrival - t.sent)  # HTTP and body parse
        rows["at the frontend (body parsed)"].append(base)
        rows["prepare reads it"].append(base + stage.read)
        rows["draft starts"].append(base + stage.draft_start)
        rows["draft ends"].append(base + stage.draft_end)
        rows["release starts (done, first in order)"].append(base + stage.release_start)
        rows["stored in the arena"].append(base + stage.stored)
        rows["Prepared sent to the conductor"].append(base + stage.sent)
        rows["draft's own time"].append(stage.draft_end - stage.draft_start)
        rows["draft's own CPU ms (its thread)"].append(stage.draft_cpu)
        rows["draft end -> release starts (in-order wait)"].append(stage.release_start - stage.draft_end)
        rows["release starts -> stored (arena put)"].append(stage.stored - stage.release_start)
        rows["stored -> sent (ring)"].append(stage.sent - stage.stored)
        rows["draft's minor page faults"].append(stage.draft_faults)
        rows["Prepared sent -> first token"].append(1e3 * t.ttft - base - stage.sent)
    out = {name: statistics.median(v) for name, v in rows.items()}
    start, end = min(t.sent for t in timed), max(t.sent + t.ttft for t in timed)
    prefills = [s for s in log.steps if start <= s.at <= end + 0.002 and s.num_new]
    if prefills:
        out["prefill steps per round"] = len(prefills) / num_rounds
        out["requests per prefill step"] = sum(s.num_new for s in prefills) / len(prefills)
        out["prefill step ms (p50)"] = statistics.median(s.ms for s in prefills)
    return out


def gil_probe(preparer, request, num_drafts: int = 10) -> str:
    """One draft beside a thread that spins a tiny Python loop, against the
    draft alone. Two figures: how much slower the draft runs there (each
    time it takes the GIL back after a C call that released it, it waits up
    to a switch interval for the spinner: a measure of how often it hands
    the GIL over, which is what costs a pool of drafts), and the share of
    the spinner's rate it lost (the draft's own Python, which holds the GIL
    while it runs). The second comes out near 0 when the draft's Python is
    a few ms in short stretches: within this probe's noise."""
    import statistics
    import threading

    def spin(seconds: float | None, stop: threading.Event, out: list) -> None:
        n, start = 0, time.perf_counter()
        while not stop.is_set() and (seconds is None or time.perf_counter() - start < seconds):
            for _ in range(100):
                pass
            n += 1
        out.append(n / (time.perf_counter() - start))

    def solo_draft_ms() -> float:
        start = time.perf_counter()
        preparer.draft(request, {})
        return 1e3 * (time.perf_counter() - start)

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # finer than the 5 ms default, so waiting for the GIL distorts less
    try:
        alone: list[float] = []
        spin(0.3, threading.Event(), alone)
        stop, beside = threading.Event(), []
        spinner = threading.Thread(target=spin, args=(None, stop, beside))
        spinner.start()
        walls = [solo_draft_ms() for _ in range(num_drafts)]
        stop.set()
        spinner.join()
    finally:
        sys.setswitchinterval(old)
    solo = statistics.median(solo_draft_ms() for _ in range(num_drafts))
    wall = statistics.median(walls)
    share = max(0.0, 1 - beside[0] / alone[0])
    held = share * wall
    return (f"GIL probe (video draft): alone {solo:.1f} ms; beside a thread spinning in Python {wall:.1f} ms "
            f"({wall / solo:.1f}x: its GIL hand-overs, each waiting up to the 0.5 ms switch interval); the spinner "
            f"lost {100 * share:.0f}% of its rate, ~{held:.1f} ms of the draft's own Python (meaningful on idle "
            f"cores only: on busy ones the spinner also loses its core)")


def drafts_at_once(preparer, request, num_drafts: int = 4, rounds: int = 3) -> str:
    """One video draft alone against ``num_drafts`` at once on as many
    threads: median wall ms of each, the drafting thread's own CPU ms, minor
    page faults and context switches per draft (voluntary ones are mostly
    waits for the GIL), at the process's own switch interval, as the pool
    runs them. The pool's time-to-first-token gain is at most about 2.5 x
    alone / at once (the inline median waits for ~2.5 drafts, the pool's for
    one among four), less what the frontend and the prefill add to both.
    When the host has the CPUs, the same number at once again with each
    thread pinned where the prepare pool would pin it (``pool_pins``), in
    the same interleaved rounds: pinned against unpinned in one run.

    Then a second pass with a watcher thread, which sleeps ``WATCH_TICK_S``
    at a time (and the switch interval set to it) and records how late it
    wakes: past the tick it waited for the GIL (or, on busy cores, for a
    core), so its longest wait is the longest stretch a draft held the GIL,
    and its waits over 0.5 ms add up to the time the drafts kept another
    thread out. That pass's drafts are not timed: the watcher's wake-ups
    every 0.2 ms make each draft hand the GIL over far more often than in
    the pool (on the 16-core host they took 1.5x the CPU of the pass above).
    On a host with more cores than drafts + 1 the waits are the GIL's; on 2
    cores CPU ms per draft is the figure to compare (wall ratios are bounded
    by the cores)."""
    import statistics
    import threading

    def timed(out: list, cpus: list[int] | None = None) -> None:
        import resource

        if cpus is not None:
            os.sched_setaffinity(threading.get_native_id(), cpus)
        before, cpu, start = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time(), time.perf_counter()
        preparer.draft(request, {})
        after = resource.getrusage(resource.RUSAGE_THREAD)
        out.append((1e3 * (time.perf_counter() - start), 1e3 * (time.thread_time() - cpu),
                    after.ru_minflt - before.ru_minflt, after.ru_nvcsw - before.ru_nvcsw))

    def together(n: int, out: list, pins: list[list[int]] | None = None) -> None:
        threads = [threading.Thread(target=timed, args=(out, pins[i] if pins else None)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def gil_waits(n: int) -> list[float]:
        waits, stop = [], threading.Event()
        watcher = threading.Thread(target=_watch_gil, args=(stop, waits))
        old = sys.getswitchinterval()
        sys.setswitchinterval(WATCH_TICK_S)  # a thread running Python hands over within a tick
        watcher.start()
        try:
            for _ in range(rounds):
                together(n, [])
        finally:
            stop.set()
            watcher.join()
            sys.setswitchinterval(old)
        return waits

    together(1, [])
    rows = {n: [] for n in (1, num_drafts)}
    pins = pool_pins(num_drafts)
    pinned: list = []
    for _ in range(rounds):  # interleaved, so a drift in the host's load hits every case alike
        for n, out in rows.items():
            together(n, out)
        if pins:
            together(num_drafts, pinned, pins)
    waits = {n: gil_waits(n) for n in rows}
    def per_draft(out: list) -> str:
        wall, cpu, faults, switches = (statistics.median(r[i] for r in out) for i in range(4))
        return (f"wall {wall:.1f} ms, CPU {cpu:.1f} ms, {faults:.0f} minor faults, {switches:.0f} "
                f"voluntary context switches per draft")

    lines = []
    for n, out in rows.items():
        long_waits = [w for w in waits[n] if w > 0.5]
        lines.append(f"{n} at once: {per_draft(out)}; GIL watcher: longest wait {max(waits[n], default=0):.1f} "
                     f"ms, waits over 0.5 ms {sum(long_waits):.0f} ms ({len(long_waits)}) in {rounds} rounds")
    if pins:
        lines.append(f"{num_drafts} at once pinned as the pool pins them (CPUs {pins}): {per_draft(pinned)}")
    else:
        lines.append(f"{num_drafts} at once pinned: not run (too few CPUs for the pool to pin {num_drafts} threads)")
    alone, at_once = (statistics.median(r[0] for r in rows[n]) for n in (1, num_drafts))
    cpu_alone, cpu_at_once = (statistics.median(r[1] for r in rows[n]) for n in (1, num_drafts))
    text = ("video drafts (" + "; ".join(lines) + f"): at once / alone {at_once / alone:.2f}x wall, "
            f"{cpu_at_once / cpu_alone:.2f}x CPU; TTFT gain bound ~2.5 x alone / at once = {2.5 * alone / at_once:.2f}x")
    if pins:
        at_once = statistics.median(r[0] for r in pinned)
        text += f"; pinned: {at_once / alone:.2f}x wall, bound {2.5 * alone / at_once:.2f}x"
    return text


def pool_pins(num_threads: int) -> list[list[int]] | None:
    """The CPUs the prepare pool would pin ``num_threads`` threads to in a
    one-GPU server on this host (``CpuPlan.pool_cpus``), or None."""
    from actors.prepare import read_cpu_cores
    from mstar_actors.cpu_plan import CpuPlan

    allowed = sorted(os.sched_getaffinity(0))
    return CpuPlan(num_cpus=len(allowed), num_ranks=1).pool_cpus(allowed, num_threads, 1, read_cpu_cores(allowed))


WATCH_TICK_S = 0.0002


def _watch_gil(stop, waits: list[float]) -> None:
    """Sleep a tick at a time until ``stop``; append how late each wake-up was, ms."""
    while not stop.is_set():
        start = time.perf_counter()
        time.sleep(WATCH_TICK_S)  # the measurement itself: how late the GIL lets us back
        waits.append(1e3 * (time.perf_counter() - start - WATCH_TICK_S))


def frontend_path(url: str, folder: Path, tmp: Path, rounds: int, concurrency: int = 4) -> str:
    """The frontend's part of time to first token, alone: ``concurrency``
    chat requests carrying ``url`` sent at once to the real ``FrontendActor``
    (its own process, uvloop), whose ``NewRequest`` crosses a real
    shared-memory ring to a stand-in for prepare (another process) that
    notes when it read each one and answers it with a 400, so nothing else
    runs. Medians over the requests of ms after the client sent: the body
    parsed (``NewRequest.arrival_time``), and read by prepare; and per body
    the frontend's CPU ms and minor page faults, the stand-in's CPU ms."""
    import multiprocessing
    import socket
    import statistics
    import uuid

    import psutil

    from transport import create_ring

    raw = json.dumps(_video_body(url, stream=True)).encode()
    run_id = uuid.uuid4().hex[:8]
    rings = (create_ring(tmp, run_id, "bench-fp", 2 * concurrency * len(raw) + (1 << 20)),
             create_ring(tmp, run_id, "bench-cf", 1 << 20))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    ready, reads = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_run_bench_frontend, args=(folder, port, rings, ready), daemon=True),
             ctx.Process(target=_run_prepare_stand_in, args=(rings, reads), daemon=True)]
    for proc in procs:
        proc.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the frontend did not start within 120 s")
        frontend, stand_in = (psutil.Process(p.pid) for p in procs)
        rows: dict[str, list[float]] = collections.defaultdict(list)
        for i in range(rounds + 1):  # the first round warms up
            cpu = [sum(p.cpu_times()[:2]) for p in (frontend, stand_in)]
            faults = _minor_faults(frontend.pid)
            sent = dict(asyncio.run(_refused_round(port, raw, concurrency)))
            got = [reads.get(timeout=60) for _ in range(concurrency)]
            if i == 0:
                continue
            rows["frontend CPU ms per body"].append(1e3 * (sum(frontend.cpu_times()[:2]) - cpu[0]) / concurrency)
            rows["prepare stand-in CPU ms per body"].append(1e3 * (sum(stand_in.cpu_times()[:2]) - cpu[1]) / concurrency)
            rows["frontend minor page faults per body"].append((_minor_faults(frontend.pid) - faults) / concurrency)
            for rid, arrival, read_at in got:
                rows["sent -> body parsed, ms"].append(1e3 * (arrival - sent[rid]))
                rows["sent -> prepare read it, ms"].append(1e3 * (read_at - sent[rid]))
    finally:
        for proc in procs:
            proc.kill()
    table = "\n".join(f"| {name} | {statistics.median(v):.1f} | {max(v):.1f} |" for name, v in rows.items())
    return (f"frontend path: {concurrency} bodies of {len(raw) / 1e6:.2f} MB at once, {rounds} rounds\n"
            f"| stage | p50 | max |\n|---|---|---|\n{table}")


def _video_body(url: str, stream: bool, model_name: str = "vl") -> dict:
    """A 2-token chat request carrying the video."""
    return {"model": model_name, "max_tokens": 2, "temperature": 0, "stream": stream, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "describe this video"},
                                                      {"type": "video_url", "video_url": {"url": url}}]}]}


def _minor_faults(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0  # not Linux


def _run_bench_frontend(folder: Path, port: int, rings, ready) -> None:
    """Process entry: the real FrontendActor on uvloop, its ``prepare`` outbox a ring."""
    import uvloop

    from actors.frontend import FrontendActor
    from mstar_actors.config import parse_config
    from mstar_actors.messages import ConductorToFrontend, FrontendToPrepare
    from transport import open_ring

    class Frontend(FrontendActor):
        async def start(self) -> None:
            await super().start()
            ready.set()

    config = parse_config({"model": {"path": str(folder), "name": "vl"},
                           "server": {"port": port, "max_body_bytes": 64 << 20, "max_media_bytes": 50 << 20}})

    async def main() -> None:
        inbox = {"conductor": open_ring(rings[1], "reader", ConductorToFrontend)}
        outbox = {"prepare": open_ring(rings[0], "writer", FrontendToPrepare)}
        await Frontend(name="frontend", config=config, inbox=inbox, outbox=outbox).run()

    uvloop.run(main())


def _run_prepare_stand_in(rings, reads) -> None:
    """Process entry: reads each NewRequest off the ring (decoded, as prepare
    does), reports (id, arrival, read time) and answers it with a 400."""
    import uvloop

    from mstar_actors.messages import ConductorToFrontend, Failed, FrontendToPrepare, NewRequest
    from transport import open_ring

    from mstar_actors.media import keep_freed_buffers

    keep_freed_buffers()  # as the prepare actor does at start

    async def main() -> None:
        inbox = open_ring(rings[0], "reader", FrontendToPrepare)
        outbox = open_ring(rings[1], "writer", ConductorToFrontend)
        while True:
            msg = await inbox.recv()
            if isinstance(msg, NewRequest):
                reads.put((msg.request_id, msg.arrival_time, time.time()))
                await outbox.send(Failed(request_id=msg.request_id, status=400, message="bench stand-in"))

    uvloop.run(main())


async def _refused_round(port: int, raw: bytes, concurrency: int) -> list[tuple[str, float]]:
    """(engine request id, time.time() sent) of each of ``concurrency`` requests sent at once."""
    import aiohttp

    headers = {"Content-Type": "application/json"}

    async def one(session) -> tuple[str, float]:
        sent = time.time()
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=raw, headers=headers) as response:
            message = (await response.json())["error"]["message"]  # "request chatcmpl-...: bench stand-in"
        return message.split(":")[0].split()[1] + "-0", sent

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session) for _ in range(concurrency))))


def progress(text: str, end: str = "\n") -> None:
    print(f"# {text}" if text else "", end=end, file=sys.stderr, flush=True)


class Report:
    """Prints the result tables, and appends them to ``$OUT/bench_prepare.md`` when ``OUT`` is set."""

    def __init__(self):
        out = os.environ.get("OUT")
        self.path = Path(out) / "bench_prepare.md" if out else None

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per batch (kind and pool size)")
    parser.add_argument("--throughput-rounds", type=int, default=5,
                        help="batches per kind and pool size, sizes taking turns (the median is reported)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of this process")
    parser.add_argument("--ttft-rounds", type=int, default=5,
                        help="bursts of 4 video requests sent at once, and requests per client in the closed loop "
                             "of 4 clients (0: skip)")
    parser.add_argument("--model", type=Path, default=None, help="a Qwen2.5-VL folder to serve for TTFT "
                                                                  "(default: a tiny random one)")
    parser.add_argument("--video-seconds", type=float, default=4.0, help="length of the clip (default 4)")
    parser.add_argument("--video-size", type=_size, default=(320, 240), metavar="WxH",
                        help="frame size of the clip (default 320x240)")
    parser.add_argument("--video-fps", type=float, default=2.0,
                        help="frames sampled per second of clip: the server's video_fps (default 2)")
    parser.add_argument("--ttft-clip", type=_clip_or_none, default=SEED_TTFT_CLIP, metavar="WxHxSECONDS",
                        help="throughput rows and time to first token again with this clip, after the default "
                             "clip's (default 640x480x16: 32 frames, a draft of ~250-600 ms on one core by host, "
                             "the regime where the seed measured TTFT halved; 'none' skips it)")
    parser.add_argument("--drafts-only", action="store_true",
                        help="only the GIL probe, one video draft alone against four at once (default clip and "
                             "--ttft-clip) and, with --frontend-rounds, the frontend path: no throughput, no TTFT")
    parser.add_argument("--ttft-only", action="store_true",
                        help="only time to first token (no throughput, GIL probe, drafts or frontend path)")
    parser.add_argument("--frontend-rounds", type=int, default=5,
                        help="rounds of 4 concurrent --ttft-clip bodies through the real frontend and a ring to a "
                             "prepare stand-in (0: skip)")
    parser.add_argument("--ttft-extra-clip", type=_clip, default=None, metavar="WxHxSECONDS",
                        help="time to first token with this clip too (e.g. 640x480x8)")
    parser.add_argument("--pool-unpinned", action="store_true",
                        help="run the pool's threads unpinned (prepare.pin_pool_threads: false) in the throughput "
                             "table and the served TTFT, to compare with a default (pinned) run on the same host")
    args = parser.parse_args()
    clip = Clip(args.video_seconds, *args.video_size, args.video_fps)
    report = Report()

    import resource

    import torch

    from mstar_actors.media import KEPT_BYTES_PER_DRAFT, MediaLimits, keep_freed_buffers
    from mstar_actors.preprocess import load_preparer

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    torch.set_num_threads(args.torch_threads)
    # As the prepare actor does for its pool: drafts here allocate as there.
    keep_freed_buffers(max_kept=KEPT_BYTES_PER_DRAFT * max(4, *args.workers))
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_vl_prepare_folder(Path(tmp) / "vl")
        limits = MediaLimits(max_bytes=50 << 20, video_fps=clip.fps, max_video_frames=max(64, clip.num_frames + 2),
                             max_video_seconds=max(120.0, clip.seconds + 1))
        preparer = load_preparer(vl_prepare_info(folder), limits)
        urls = {"image": jpeg_data_url(), "video": mp4_data_url(clip.seconds, width=clip.width, height=clip.height)}
        report(f"# {platform.node()} {os.cpu_count()} cpus (affinity {len(os.sched_getaffinity(0))}), "
               f"torch threads {torch.get_num_threads()}, pool threads "
               f"{'unpinned' if args.pool_unpinned else 'pinned where the CPUs allow'}, {args.requests} requests per batch; video "
               f"{clip.seconds:g} s {clip.width}x{clip.height} sampled at {clip.fps:g} fps ({clip.num_frames} frames)")
        heavy = args.ttft_clip and Clip(args.ttft_clip[2], *args.ttft_clip[:2], clip.fps)
        heavy_url = heavy and mp4_data_url(heavy.seconds, width=heavy.width, height=heavy.height)
        if not (args.drafts_only or args.ttft_only):
            media = {"image": Media("image", urls["image"], args.requests),
                     f"video {clip.width}x{clip.height} {clip.seconds:g} s": Media("video", urls["video"], args.requests)}
            if heavy:  # the seed's regime: fewer requests, each ~10x the default clip's draft
                media[f"video {heavy.width}x{heavy.height} {heavy.seconds:g} s"] = Media(
                    "video", heavy_url, max(8, args.requests // 2))
            throughput(report, args, preparer, media, cpu_s)
        if not args.ttft_only:
            progress("GIL probe (video draft)")
            report("\n" + gil_probe(preparer, make_request("gil", "video", urls["video"])))
            report("\n" + drafts_at_once(preparer, make_request("at-once", "video", urls["video"])))
            if heavy:
                report(f"\n{heavy.width}x{heavy.height} {heavy.seconds:g} s clip: "
                       + drafts_at_once(preparer, make_request("at-once", "video", heavy_url)))
            if args.frontend_rounds:
                progress("frontend path")
                report("\n" + frontend_path(heavy_url or urls["video"], folder, Path(tmp), args.frontend_rounds))
        if args.drafts_only or not args.ttft_rounds:
            return
        ratios = {clip: run_ttft(report, args, clip, urls["video"], Path(tmp))}
        for extra in (args.ttft_clip, args.ttft_extra_clip):
            if extra is None:
                continue
            width, height, seconds = extra
            extra_clip = Clip(seconds, width, height, clip.fps)
            progress(f"TTFT again with a {width}x{height} {seconds:g} s clip")
            url = heavy_url if extra_clip == heavy else mp4_data_url(seconds, width=width, height=height)
            ratios[extra_clip] = run_ttft(report, args, extra_clip, url, Path(tmp))
        report("\n| video TTFT at concurrency 4, clip | inline / pool, bursts | inline / pool, closed loop |"
               "\n|---|---|---|")
        for c, (in_bursts, in_loop) in ratios.items():
            report(f"| {c.width}x{c.height} {c.seconds:g} s ({c.num_frames} frames) | {in_bursts:.2f}x | {in_loop:.2f}x |")


class Batch(NamedTuple):
    done: list[float]  # s from the first request sent to each result, in order
    workers: int
    cpu: float  # s of the process's CPU
    drafting: float  # s of draft wall time summed over the batch's requests
    draft_cpu: float  # s of the drafting threads' own CPU over them

    @property
    def elapsed(self) -> float:
        """The whole batch: its last result."""
        return self.done[-1]

    @property
    def rate(self) -> float:
        """Requests a second in the batch's steady middle: results between
        the first wave's last one (result W, for W workers) and the one after
        which the last request must have started (result N - W), over the
        time between them. Outside it are the start (W drafts that began
        together finish close together, whatever the rate) and the drain
        (threads idling one by one with nothing left to take), which a loaded
        server does not have and a batch of N has by construction. A batch
        too small for a middle (N <= 2W) counts whole."""
        n, w = len(self.done), self.workers
        if n <= 2 * w:
            return n / self.elapsed
        return (n - 2 * w) / (self.done[n - w - 1] - self.done[w - 1])


class Media(NamedTuple):
    """One row group of the throughput table: ``kind`` (image / video) of the
    content part, its data: URL, and requests per batch."""

    kind: str
    url: str
    requests: int


def throughput(report: "Report", args, preparer, media: dict[str, Media], cpu_s) -> None:
    """The preparation throughput table: every media at every pool size,
    through the prepare actor and, as a reference, the same drafts on a bare
    thread pool (``PlainPool``). Each pool size is one actor (or plain pool)
    kept running and warmed; sizes and both kinds of pool take turns, batch
    by batch, for ``--throughput-rounds`` rounds, so a drift in the host's
    load hits every cell alike. Each cell is the median round. Requests a
    second are counted in the batch's steady middle (``Batch.rate``: the
    first wave and the drain, threads idling one by one at the end, are
    left out; the drain alone idles one thread of two for about half a
    draft). The speed-up is paired: the median over rounds of this size's
    rate over the 1-worker rate of the same round (actor against the inline
    actor, plain against one plain thread), with the rounds' range (on a
    shared host the same draft's speed moves by a third within a minute);
    *whole batch* is the same ratio of the batches' whole times, drain
    included. Two more columns split a shortfall: *threads drafting* is the
    drafts' wall time over workers x batch time (below 100%: threads idle,
    waiting for the loop), and *draft CPU / wall* the drafting threads' CPU
    over their drafts' wall (below the 1-worker figure: drafts wait for the
    GIL or a core beside one another)."""
    import statistics

    report(f"\nMedian of {args.throughput_rounds} rounds (sizes and pools interleaved); \"actor\": through "
           "the prepare actor (1 worker: inline); \"plain\": the same drafts on a bare thread pool")
    report("\n| media | pool | workers | requests | req/s | ms/req | CPU ms/req | threads drafting | "
           "draft CPU / wall | speed-up (rounds' range) | whole batch |\n|---|---|---|---|---|---|---|---|---|---|---|")

    async def measure(label: str, kind: str, url: str, num_requests: int) -> dict[tuple[str, int], list[Batch]]:
        pools = {("actor", w): ActorUnderTest(preparer, w, pin=not args.pool_unpinned) for w in args.workers}
        pools.update({("plain", w): PlainPool(preparer, w, pin=not args.pool_unpinned) for w in args.workers})
        rounds: dict[tuple[str, int], list[Batch]] = {key: [] for key in pools}
        try:
            for pool in pools.values():
                await pool.warm_up(lambda rid: make_request(rid, kind, url))
            for r in range(args.throughput_rounds):
                for (name, workers), pool in pools.items():
                    requests = [make_request(f"{kind}-{name}{workers}-{r}-{i}", kind, url) for i in range(num_requests)]
                    cpu = cpu_s()
                    done = await pool.batch(requests)
                    rounds[name, workers].append(Batch(done, workers, cpu_s() - cpu, sum(w for w, _ in pool.drafts),
                                                       sum(c for _, c in pool.drafts)))
                progress(f"{label}: round {r + 1}/{args.throughput_rounds}", end="\r")
        finally:
            for pool in pools.values():
                await pool.close()
        progress("")
        return rounds

    for label, (kind, url, num_requests) in media.items():
        rounds = asyncio.run(measure(label, kind, url, num_requests))
        for (name, workers), batches in rounds.items():
            base = rounds[name, args.workers[0]]
            rate, cpu = statistics.median(b.rate for b in batches), statistics.median(b.cpu for b in batches)
            busy = statistics.median(b.drafting / (workers * b.elapsed) for b in batches)
            draft_cpu = statistics.median(b.draft_cpu / b.drafting for b in batches)
            ratios = [b.rate / b0.rate for b0, b in zip(base, batches)]
            whole = statistics.median(b0.elapsed / b.elapsed for b0, b in zip(base, batches))
            report(f"| {label} | {name} | {workers} | {num_requests} | {rate:.1f} | {1000 / rate:.1f} | "
                   f"{1000 * cpu / num_requests:.1f} | {busy:.0%} | {draft_cpu:.0%} | {statistics.median(ratios):.2f}x "
                   f"({min(ratios):.2f}-{max(ratios):.2f}) | {whole:.2f}x |")


def run_ttft(report: "Report", args, clip: Clip, url: str, tmp: Path) -> tuple[float, float]:
    """Time to first token of ``clip`` at concurrency 4, pool against inline,
    and its stages; returns inline / pool in bursts and in the closed loop."""
    # The tiny model keeps Qwen2.5-VL's processor (14 px patches, frames up to 28*28*1280 px), so
    # the server decodes, resizes and patches the clip as for a real model: TTFT is mostly that.
    max_model_len = None if args.model else context_for(clip)
    model_dir = args.model or save_tiny_vl_model(tmp / f"tiny-vl-{max_model_len}", real_patches=True,
                                                 max_model_len=max_model_len)
    runs, num_prompt_tokens = measure_ttft(model_dir, url, tmp, args.ttft_rounds, clip,
                                           max_model_len=max_model_len, pin=not args.pool_unpinned)
    report(f"\nvideo {clip.seconds:g} s {clip.width}x{clip.height} at {clip.fps:g} fps ({clip.num_frames} frames, "
           f"{len(url) >> 10} KiB data: URL)")
    return report_ttft(report, runs, num_prompt_tokens, max_model_len)


def report_ttft(report: Report, runs: dict[int, TtftRun], num_prompt_tokens: int,
                max_model_len: int | None) -> tuple[float, float]:
    """Prints the clip's TTFT table and stages; returns inline / pool in bursts and in the closed loop."""
    ttft = "first token at the client (TTFT)"
    burst = {n: ttft_stages(runs[n].burst, runs[n].log, len(runs[n].burst) // 4) for n in (4, 1)}
    closed = {n: ttft_stages(runs[n].closed, runs[n].log, len(runs[n].closed) // 4) for n in (4, 1)}
    rate = {n: len(runs[n].closed) / runs[n].closed_span for n in (4, 1)}
    ratios = burst[1][ttft] / burst[4][ttft], closed[1][ttft] / closed[4][ttft]
    report(f"\nserved video prompt: {num_prompt_tokens} tokens, context {max_model_len or 'of the model'}; "
           f"{len(runs[4].burst)} requests per mode in bursts of 4 sent at once, {len(runs[4].closed)} in a closed "
           f"loop of 4 clients (each sends its next request when its last one has answered)")
    report("| video TTFT, concurrency 4, p50 ms | bursts | closed loop | closed loop req/s |\n|---|---|---|---|")
    report(f"| pool (4 workers) | {burst[4][ttft]:.0f} | {closed[4][ttft]:.0f} | {rate[4]:.2f} |")
    report(f"| inline (1) | {burst[1][ttft]:.0f} | {closed[1][ttft]:.0f} | {rate[1]:.2f} |")
    report(f"| inline / pool | {ratios[0]:.2f}x | {ratios[1]:.2f}x | {rate[4] / rate[1]:.2f}x |")
    report("\n| stage, ms after the client sent (p50 over requests) | pool, bursts | inline, bursts "
           "| pool, closed loop | inline, closed loop |\n|---|---|---|---|---|")
    for name in burst[1]:
        cells = [table.get(name) for table in (burst[4], burst[1], closed[4], closed[1])]
        report(f"| {name} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
    return ratios


def _clip(text: str) -> tuple[int, int, float]:
    try:
        width, height, seconds = text.lower().split("x")
        return (*_size(f"{width}x{height}"), float(seconds))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WIDTHxHEIGHTxSECONDS, e.g. 640x480x8") from None


SEED_TTFT_CLIP = (640, 480, 16.0)


def _clip_or_none(text: str) -> tuple[int, int, float] | None:
    return None if text.lower() == "none" else _clip(text)


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WIDTHxHEIGHT, e.g. 320x240") from None
    if width < 16 or height < 16 or width % 2 or height % 2:
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be even and at least 16")
    return width, height


if __name__ == "__main__":
    main()
