"""The SNAC decoder that turns Orpheus's codes into 16-bit PCM, off the event loop.

``SnacCodec.load(folder)`` reads a local SNAC folder (``config.json`` and
``pytorch_model.bin`` or ``model.safetensors``, as the hub's
``hubertsiuzdak/snac_24khz`` ships them; nothing is fetched). Decoding runs
on the codec's one thread (``executor``): every window of every request is
decoded there, in turn, so the frontend's loop only awaits it.

SNAC's decoder adds noise scaled by the signal (its ``NoiseBlock``). Each
window is decoded under the same seed, on this one thread: the same codes
make the same samples, so a streamed response has the bytes of a whole one.
The frontend's process runs no other torch code that draws random numbers.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mstar_actors.speech.orpheus import CODEBOOK_SLOTS, Window, codebook_rows

ORPHEUS_STRIDES = [4, 2, 1]  # the codebooks' strides that Orpheus's 7-token frame is laid out for
NOISE_SEED = 0


class CodecLoadError(ValueError):
    """A SNAC folder that can't decode Orpheus's codes; the message names what is wrong."""


class SnacCodec:
    """A loaded SNAC decoder and the thread it decodes on."""

    def __init__(self, model: Any, device: str):
        self.model = model
        self.device = device
        self.sample_rate = int(model.sampling_rate)
        self.codebook_size = int(model.codebook_size)
        self.frame_samples = int(model.hop_length) * ORPHEUS_STRIDES[0]  # one frame: 4 latent steps
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snac-codec")

    @classmethod
    def load(cls, folder: str | Path, device: str = "cpu", num_threads: int | None = None) -> SnacCodec:
        import torch
        from snac import SNAC

        folder = Path(folder).expanduser()
        config = _read_config(folder)
        model = SNAC(**config)
        model.load_state_dict(_read_weights(folder, torch))
        del model.encoder  # only codes are decoded here
        _fold_weight_norm(model, torch)
        if num_threads is not None and device == "cpu":
            torch.set_num_threads(num_threads)  # this process's only torch work
        return cls(model.eval().to(device), device)

    def decode(self, frames: list[tuple[int, ...]]) -> bytes:
        """Little-endian 16-bit PCM of consecutive frames decoded as one window
        (on the codec's thread)."""
        import numpy as np
        import torch

        codes = [torch.tensor([row], dtype=torch.long, device=self.device) for row in codebook_rows(frames)]
        with torch.inference_mode():
            torch.manual_seed(NOISE_SEED)
            audio = self.model.decode(codes)[0, 0].float().cpu().numpy()
        return (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()

    def window_pcm(self, frames: list[tuple[int, ...]], windows: list[Window]) -> tuple[bytes, bytes | None]:
        """The bytes the windows send, and the last window's whole decode
        (its held-back frames are sent at the end); on the codec's thread."""
        out, last = [], None
        bytes_per_frame = 2 * self.frame_samples
        for w in windows:
            last = self.decode(frames[w.first:w.first + w.num_frames])
            out.append(last[w.emit_from * bytes_per_frame:w.emit_to * bytes_per_frame])
        return b"".join(out), last

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def check_folder(folder: str | Path) -> None:
    """``CodecLoadError`` naming what the SNAC folder lacks (its config, its
    weights), found before any actor starts (no torch, no weights read)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise CodecLoadError(f"speech.snac_path: {folder} is not a folder; it needs SNAC's config.json and "
                             "pytorch_model.bin (see configs/orpheus.yaml)")
    _read_config(folder)
    if not any((folder / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")):
        raise CodecLoadError(f"speech.snac_path: {folder} has neither pytorch_model.bin nor model.safetensors")


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CodecLoadError(f"speech.snac_path: {path} not found; the folder needs SNAC's config.json and "
                             "pytorch_model.bin (see configs/orpheus.yaml)") from None
    except ValueError as err:
        raise CodecLoadError(f"speech.snac_path: {path} is not JSON: {err}") from None
    strides = config.get("vq_strides")
    if strides != ORPHEUS_STRIDES:
        raise CodecLoadError(f"speech.snac_path: vq_strides {strides} in {path}; Orpheus's frames of "
                             f"{sum(map(len, CODEBOOK_SLOTS))} codes need a SNAC of vq_strides {ORPHEUS_STRIDES} "
                             "(hubertsiuzdak/snac_24khz)")
    return config


def _read_weights(folder: Path, torch: Any) -> dict:
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    path = folder / "pytorch_model.bin"
    if not path.exists():
        raise CodecLoadError(f"speech.snac_path: {folder} has neither pytorch_model.bin nor model.safetensors")
    return torch.load(str(path), map_location="cpu", weights_only=True)


def _fold_weight_norm(model: Any, torch: Any) -> None:
    """Compute each weight-normed convolution's weight once, not at every decode
    (the same computation, so the same weights)."""
    from torch.nn.utils import parametrize

    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
