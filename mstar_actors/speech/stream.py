"""One speech request's codec tokens in, PCM bytes out as frames complete.

``load_speech`` makes the served model's ``Speech`` once (the codec and the
Orpheus token ids of its tokenizer); ``Speech.stream()`` starts a request's
``SpeechStream``, whose ``feed`` and ``finish`` await the codec's thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mstar_actors.speech.orpheus import WINDOW_FRAMES, FrameReader, OrpheusTokens, WindowPlan
from mstar_actors.speech.snac_codec import SnacCodec

if TYPE_CHECKING:
    from mstar_actors.config import SpeechConfig


@dataclass
class Speech:
    codec: SnacCodec
    tokens: OrpheusTokens

    def stream(self) -> SpeechStream:
        return SpeechStream(self.codec, self.tokens)

    def close(self) -> None:
        self.codec.close()


def load_speech(config: SpeechConfig, vocab: dict[str, int], vocab_size: int) -> Speech:
    """The codec at ``config.snac_path`` and the model's Orpheus tokens (blocking:
    run it off the loop). Raises ValueError naming what does not fit."""
    from mstar_actors.speech.orpheus import OrpheusFormatError

    device = config.codec_device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    codec = SnacCodec.load(config.snac_path, device, config.codec_threads)
    try:
        tokens = OrpheusTokens.from_vocab(vocab, codec.codebook_size)
    except OrpheusFormatError:
        codec.close()
        raise
    if tokens.code_end > vocab_size:
        codec.close()
        raise OrpheusFormatError(f"the codec tokens end at id {tokens.code_end}, past the model's "
                                 f"{vocab_size} embedding rows")
    return Speech(codec, tokens)


class SpeechStream:
    """Frames are read from the tokens as they come (``FrameReader``), windows
    planned (``WindowPlan``) and decoded on the codec's thread. Not for two
    tasks at once: one request's ``feed`` calls are awaited in turn."""

    def __init__(self, codec: SnacCodec, tokens: OrpheusTokens):
        self.codec = codec
        self.reader = FrameReader(tokens)
        self.plan = WindowPlan()
        self.frames: list[tuple[int, ...]] = []
        self._last_window: bytes | None = None  # the last window's whole decode

    async def feed(self, token_ids: list[int]) -> bytes:
        """The PCM bytes the new tokens complete (often none)."""
        new = self.reader.feed(token_ids)
        self.frames += new
        windows = self.plan.add(len(new))
        if not windows:
            return b""
        loop = asyncio.get_running_loop()
        pcm, self._last_window = await loop.run_in_executor(self.codec.executor, self.codec.window_pcm,
                                                            list(self.frames), windows)
        return pcm

    async def finish(self) -> bytes:
        """The rest, once the model has stopped."""
        window = self.plan.finish()
        if window is None:
            return b""
        if window.num_frames == WINDOW_FRAMES:  # the last window was decoded already: its held-back tail
            bytes_per_frame = 2 * self.codec.frame_samples
            return self._last_window[window.emit_from * bytes_per_frame:]
        loop = asyncio.get_running_loop()
        pcm, _ = await loop.run_in_executor(self.codec.executor, self.codec.window_pcm, list(self.frames), [window])
        return pcm
