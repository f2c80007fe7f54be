"""One rank's media state for a multimodal model: per-sequence rotary
positions and vision (or audio) rows, turned into a step's inputs.

At ``start`` a sequence's media items are checked against its prompt (each
placeholder run holds exactly the item's token id, ``num_tokens`` matches
the grid) and its multimodal positions are computed once. At each step,
``step_inputs`` gives the flat batch's positions and the rows whose token
embeddings are replaced by the encoder's rows. Positions are ``[3, T]`` for
a model with multimodal rotary (it has ``mrope_positions``), else plain
``[T]`` token indices (Qwen2-Audio: its audio runs count like text); a model
without a vision tower checks its items' geometry itself
(``media_item_problem``).

Vision rows of an item are computed the first time a chunk reaches its
placeholder run, for every such item of the step in one tower call, and
kept until a chunk has consumed the run's last token: chunked prefill that
splits a run does not run the tower twice. A restarted sequence (after a
preemption) starts afresh, so its rows are recomputed from the pixel values,
which must therefore stay readable until the request has really finished.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mstar_actors import messages

if TYPE_CHECKING:
    from .attention import AttentionMetadata

TensorResolver = Callable[[messages.TensorRef], torch.Tensor]


class MediaSplice:
    """The forward of a multimodal causal LM, mixed in before its ``CausalLM``
    base (which supplies ``model.embed_tokens`` and ``run_layers``):
    ``media_rows``, (flat row indices, encoder rows) from ``step_inputs``,
    replace those rows' token embeddings before the first layer."""

    is_multimodal = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, media_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if media_rows is not None:
            rows, values = media_rows
            x = x.index_copy(0, rows, values.to(x.dtype))
        return self.run_layers(x, positions, kv_caches, meta)


@dataclass
class SeqMedia:
    items: list[messages.MediaItem]
    num_prompt: int
    positions: torch.Tensor | None  # [3, num_prompt] int64 on the CPU; None: plain 1-D positions
    rope_delta: int
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # item index -> encoder rows, until consumed


class MediaInputs:
    """Not thread-safe; owned by the ``ModelRunner`` and called in plan order."""

    def __init__(self, model, resolve: TensorResolver | None):
        self.model = model
        self.resolve = resolve
        self.is_mrope = hasattr(model, "mrope_positions")
        self.seqs: dict[str, SeqMedia] = {}

    def start(self, request_id: str, prompt_token_ids: list[int], media: list[messages.MediaItem]) -> None:
        """Remember (or replace) a sequence; ``ValueError`` names the item at fault."""
        self.seqs.pop(request_id, None)
        if not media:
            return  # a text prompt: plain positions, nothing to splice
        items = sorted(media, key=lambda m: m.token_offset)
        for i, item in enumerate(items):
            self._check_item(request_id, i, item, prompt_token_ids, items[i - 1] if i else None)
        positions, delta = self.model.mrope_positions(len(prompt_token_ids), items) if self.is_mrope else (None, 0)
        self.seqs[request_id] = SeqMedia(items, len(prompt_token_ids), positions, delta)

    def forget(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def step_inputs(
        self, spans: list[tuple[str, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``spans``: (request id, first token index, stop) of each chunk, in
        batch order. Returns ``positions`` (``[3, T]``, or ``[T]`` without
        multimodal rotary) and, when any chunk covers placeholder tokens,
        ``(flat row indices, encoder rows)``."""
        self._encode_missing(spans, device)
        positions, row_ids, row_values, base = [], [], [], 0
        for rid, start, stop in spans:
            seq = self.seqs.get(rid)
            positions.append(_positions(seq, start, stop) if self.is_mrope else torch.arange(start, stop))
            if seq is not None:
                for ids, values in self._splice(seq, start, stop, base):
                    row_ids.append(ids)
                    row_values.append(values)
            base += stop - start
        flat = torch.cat(positions, dim=-1).to(device)
        if not row_ids:
            return flat, None
        return flat, (torch.cat(row_ids).to(device), torch.cat(row_values))

    # -- internals ---------------------------------------------------------------

    def _encode_missing(self, spans: list[tuple[str, int, int]], device: torch.device) -> None:
        """Run the tower once over every item this step reaches that has no rows yet."""
        needed = []
        for rid, start, stop in spans:
            seq = self.seqs.get(rid)
            for i, item in enumerate(seq.items if seq else ()):
                if i not in seq.rows and _overlaps(item, start, stop):
                    needed.append((seq, i, item))
        if not needed:
            return
        # One tensor per item, not concatenated: the tower embeds each on its
        # own, so the pixel rows are copied only host -> device.
        pixels = [self._pixels(item, device) for _, _, item in needed]
        rows = self.model.encode_media(pixels, [tuple(item.grid_thw) for _, _, item in needed])
        for (seq, i, _), item_rows in zip(needed, rows.split([item.num_tokens for _, _, item in needed]), strict=True):
            seq.rows[i] = item_rows

    def _pixels(self, item: messages.MediaItem, device: torch.device) -> torch.Tensor:
        if self.resolve is None:
            raise ValueError("this runner has no tensor resolver, so it can't read media pixel_values")
        # non_blocking: a pinned host copy goes by DMA, queued behind nothing
        # the host must wait for; a pageable one is copied synchronously anyway.
        return self.resolve(item.pixel_values).to(device, non_blocking=True)

    def _splice(self, seq: SeqMedia, start: int, stop: int, base: int):
        """(flat row ids, vision rows) for each item overlapping ``[start, stop)``;
        an item's rows are dropped once its run's last token is consumed."""
        for i, item in enumerate(seq.items):
            if not _overlaps(item, start, stop):
                continue
            end = item.token_offset + item.num_tokens
            lo, hi = max(start, item.token_offset), min(stop, end)
            yield torch.arange(base + lo - start, base + hi - start), seq.rows[i][lo - item.token_offset : hi - item.token_offset]
            if hi == end:
                del seq.rows[i]

    def _check_item(self, rid, i, item, prompt, previous) -> None:
        where = f"request {rid!r}: media[{i}] ({item.kind})"
        token_id = self.model.media_token_ids.get(item.kind)
        if token_id is None:
            raise ValueError(f"{where}: kind {item.kind!r} is not supported; accepted: {', '.join(self.model.media_token_ids)}")
        check = getattr(self.model, "media_item_problem", None)
        problem = check(item) if check is not None else _vision_problem(self.model.vision_spec, item)
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        end = item.token_offset + item.num_tokens
        if previous is not None and item.token_offset < previous.token_offset + previous.num_tokens:
            raise ValueError(f"{where}: placeholder run at {item.token_offset} overlaps the previous item's")
        if item.token_offset < 0 or end > len(prompt) or any(tok != token_id for tok in prompt[item.token_offset : end]):
            raise ValueError(f"{where}: prompt tokens [{item.token_offset}, {end}) must all be the {item.kind} token {token_id}")


def _vision_problem(vision, item: messages.MediaItem) -> str | None:
    """Why a vision item's grid, token count or pixel rows don't agree, or None."""
    merge = vision.spatial_merge_size
    t, h, w = item.grid_thw
    if min(t, h, w) < 1 or h % merge or w % merge:
        return f"grid_thw {list(item.grid_thw)} needs positive t, and h, w multiples of {merge}"
    if item.num_tokens != t * h * w // merge**2:
        return f"num_tokens={item.num_tokens}, but grid_thw {list(item.grid_thw)} gives t*h*w/{merge**2} = {t * h * w // merge**2}"
    expected = (t * h * w, vision.patch_dim)
    if tuple(item.pixel_values.shape) != expected:
        return f"pixel_values has shape {list(item.pixel_values.shape)}, expected {list(expected)}"
    return None


def _overlaps(item: messages.MediaItem, start: int, stop: int) -> bool:
    return item.token_offset < stop and start < item.token_offset + item.num_tokens


def _positions(seq: SeqMedia | None, start: int, stop: int) -> torch.Tensor:
    """``[3, stop - start]``: the prompt's precomputed positions, then token index + rope delta."""
    if seq is None:
        return torch.arange(start, stop).expand(3, -1)
    head = seq.positions[:, start : min(stop, seq.num_prompt)]
    tail = torch.arange(max(start, seq.num_prompt), max(stop, seq.num_prompt)) + seq.rope_delta
    return torch.cat([head, tail.expand(3, -1)], dim=1)
