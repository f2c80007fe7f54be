"""Model-specific preparation, chosen by the launcher's ``ModelInfo``.

A preparer turns one ``NewRequest`` (plus the bytes of its http(s) media,
fetched beforehand on the actor's loop) into a ``Draft``: the ``Prepared``
message without its media references, and the media tensors still in process
memory. The prepare actor stores those tensors in the arena and sends the
message when the request's turn comes (``with_media``).

``PREPROCESS_PARALLEL`` on the preparer class is the declaration the prepare
actor reads: True when ``draft`` keeps no shared mutable state, so several
requests may be drafted at once on the pool's threads.

- Text models (``Preparer``): False. Encoding with the
  HF fast tokenizer is thread-safe as we call it (no truncation/padding
  toggles), but one prompt takes well under a millisecond and the Rust
  encoder holds the GIL, so a pool would only add a thread hop.
- Qwen2.5-VL (``QwenVLPreparer``): True. The image processor, the tokenizer
  and the limits are read-only after construction; every request decodes
  into its own arrays; Pillow, ffmpeg (``av``), numpy and torch release the
  GIL in the heavy parts, so decode and pixel work overlap across threads.
- Qwen2-Audio (``AudioPreparer``): True: the Whisper feature extractor is
  read-only after construction (its mel filters and window are made per call
  or kept as constants). But a clip's decode (PyAV's frame by frame loop)
  and the extractor's numpy steps hold the GIL most of their 20 ms, so
  threads barely overlap them (2 threads 1.2-1.5x on 2 cores, 4 on 16 cores
  0.75-1.5x: docs/benchmarks.md); with a pool (``start_processes``) each
  clip is decoded and featurised in a process of its own, the pool's
  thread waiting for it (the GIL released), the bytes in and the frames out
  passing through shared memory (``clip_processes``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from mstar_actors.frontend.tool_calls import call_parameters
from mstar_actors.prepare.audio_features import load_feature_extractor, prepare_clip
from mstar_actors.prepare.media import (
    AUDIO_KINDS,
    MEDIA_PART_TYPES,
    VISION_KINDS,
    Abandoned,
    MediaError,
    MediaLimits,
    MediaRef,
    collect_media,
    decode_image,
    decode_frame_list,
    decode_video,
    is_frame_list,
    part_names,
    read_local,
    source_digest,
)
from mstar_actors.messages import ChatMessage, Failed, MediaItem, NewRequest, Prepared, StructuredSpec, TensorRef
from mstar_actors.prepare.prompt_bound import PromptTooLong
from mstar_actors.tokenization import TemplateRefused

if TYPE_CHECKING:
    from mstar_actors.model_info import ModelInfo


@dataclass
class MediaDraft:
    """One MediaItem whose pixel rows (an audio clip's mel frames) are still a CPU tensor."""

    kind: str
    pixel_values: Any  # torch.Tensor (num_patches, patch_dim), float32; audio: (frames kept, num_mel_bins)
    grid_thw: tuple[int, int, int]
    token_offset: int
    num_tokens: int
    second_per_grid_t: float = 0.0
    timestamps: tuple[float, ...] = ()  # Qwen3.5 videos: each temporal patch's time (s), written into the prompt
    # blake2b of the item's encoded bytes: the server's processing is fixed, so
    # equal bytes give equal pixel rows, and hashing them is ~15x cheaper (470 KB
    # of mp4 against 7.5 MB of float rows). Empty: the digest hashes the rows.
    source_digest: bytes = b""


@dataclass
class Draft:
    prepared: Prepared  # media=[]: filled in by with_media
    media: list[MediaDraft] = field(default_factory=list)


def with_media(draft: Draft, refs: list[TensorRef]) -> Prepared:
    """The message to send: the draft's Prepared with one MediaItem per stored
    tensor (``refs[i]`` holds ``draft.media[i].pixel_values``)."""
    if len(refs) != len(draft.media):
        raise ValueError(f"request {draft.prepared.request_id}: {len(refs)} stored tensors for {len(draft.media)} items")
    media = [
        MediaItem(kind=m.kind, pixel_values=ref, grid_thw=m.grid_thw, token_offset=m.token_offset,
                  num_tokens=m.num_tokens, second_per_grid_t=m.second_per_grid_t)
        for m, ref in zip(draft.media, refs)
    ]
    return msgspec.structs.replace(draft.prepared, media=media)


# --------------------------------------------------------------------------
# Text models
# --------------------------------------------------------------------------


class Preparer:
    """Turns one text request into token ids. No I/O after construction.

    ``tokenization`` provides ``encode_text(text, add_special_tokens,
    max_tokens) -> list[int]``, ``with_special_tokens(ids)`` and
    ``apply_chat_template(messages, add_generation_prompt, max_tokens) ->
    list[int]``, raising PromptTooLong for a text of ``max_tokens`` or more
    before tokenizing all of it. ``prompt_limit`` (the launcher's
    ``max_model_len``) bounds that work; the scheduler's length check is the
    one that decides, and refuses such a prompt anyway.
    """

    PREPROCESS_PARALLEL = False  # see the module docstring
    PREPARES_MEDIA = False  # image/video parts are refused by the chat template path

    def __init__(self, tokenization: Any, prompt_limit: int | None = None, grammars: Any = None):
        self.tokenization = tokenization
        self.prompt_limit = prompt_limit  # a prompt of this many tokens can't be served
        self.grammars = grammars  # a runner.grammar.GrammarCompiler, or None: structured outputs refused

    def prepare(self, req: NewRequest) -> Prepared | Failed:
        result = self.draft(req, {})
        return result.prepared if isinstance(result, Draft) else result

    def draft(self, req: NewRequest, fetched: dict[str, bytes] | None = None, *,
              abandoned: Callable[[], bool] = lambda: False) -> Draft | Failed:
        """``req``'s prompt (``abandoned``: a media draft's question between its items, whether its client left)."""
        if (refusal := self.check_structured(req) or _media_refused(req)) is not None:
            return refusal
        try:
            token_ids, param = prompt_token_ids(self.tokenization, req, self.prompt_limit)
        except PromptTooLong as err:
            return failed(req, too_long(err.min_tokens, err.limit, is_lower_bound=True), _param_of(req),
                          code="context_length_exceeded")
        except TemplateRefused as err:  # as the frontend's /tokenize says it
            return failed(req, f"{_param_of(req)}: {err}", _param_of(req))
        except Exception as err:  # the client's input broke tokenization: its request alone fails
            return failed(req, f"could not prepare the request: {type(err).__name__}: {err}", _param_of(req))
        problem = self.check(token_ids)
        if problem:
            return failed(req, problem, param)
        return Draft(Prepared(
            request_id=req.request_id,
            model=req.model,
            prompt_token_ids=token_ids,
            sampling=req.sampling,
            arrival_time=req.arrival_time,
            prompt_param=param,
            n=req.n,
            cache_salt=req.cache_salt,
            return_prompt_ids=req.return_prompt_ids,
        ))

    def check_structured(self, req: NewRequest) -> Failed | None:
        """Check the request's grammar (its rules, not the token masks the
        ranks compile beside their steps): a bad spec is its 400 here, before
        anything reaches the conductor or the ranks."""
        spec = req.sampling.structured
        if spec is None:
            return None
        param = spec.param or "structured_outputs"
        if self.grammars is None:
            return failed(req, "structured outputs are off on this server", param)
        from mstar_actors.runner.grammar import GrammarError

        try:
            self.grammars.check(spec)
        except GrammarError as err:
            param, err = self._blame_tool(req, spec) or (param, err)
            return failed(req, f"{param}: {err}", param)
        return None

    def _blame_tool(self, req: NewRequest, spec: StructuredSpec) -> tuple[str, Exception] | None:
        """A forced call's schema joins its tools' parameters: the first of them
        refused alone, as ``(tools[i].function.parameters, its reason)``."""
        from mstar_actors.runner.grammar import GrammarError

        if spec.param not in ("tool_choice", "tools") or not req.tools:
            return None
        forced = json.loads(spec.spec)
        if spec.kind == "tagged_calls":  # an auto reply's strict tools, each alone, and its answer's rule
            answer = forced.get("answer")
            if answer is not None:
                try:
                    self.grammars.check(StructuredSpec(answer["kind"], answer["spec"]))
                except GrammarError as err:
                    return answer["param"] or "response_format", err
            xml = any("functions" in tag for tag in forced["tags"])
            alone = [(f["name"], StructuredSpec("xml_calls", json.dumps({
                "functions": [{"name": f["name"], "parameters": call_parameters(f)}], "separator": "", "end": "",
                "repeat": False})) if xml else StructuredSpec("json", json.dumps(call_parameters(f))))
                     for f in (t["function"] for t in req.tools) if f.get("strict") is True]
        elif spec.kind == "xml_calls":  # each function's call alone
            alone = [(f["name"], StructuredSpec("xml_calls", json.dumps(forced | {"functions": [f], "repeat": False})))
                     for f in forced["functions"]]
        else:
            forced = forced["schema"] if spec.kind == "json_calls" else forced  # parallel calls: one call's schema
            names = {branch["properties"]["name"]["enum"][0] for branch in forced.get("anyOf", [forced])}
            alone = [(t["function"]["name"], StructuredSpec("json", json.dumps(call_parameters(t["function"]))))
                     for t in req.tools if t["function"]["name"] in names]
        where = {tool["function"]["name"]: i for i, tool in enumerate(req.tools)}
        for name, one in alone:
            try:
                self.grammars.check(one)
            except GrammarError as err:
                return f"tools[{where[name]}].function.parameters", err
        return None

    def check(self, token_ids: list[int]) -> str | None:
        """Token ids are the frontend's to check (``openai_api.parse_prompts``),
        the prompt's length the scheduler's."""
        if not token_ids:
            return "the prompt is empty: send at least one token"
        return None



def prompt_token_ids(tokenization: Any, req: NewRequest, prompt_limit: int | None) -> tuple[list[int], str]:
    """A text request's prompt ids and the field they came from, as the engine
    serves them: its chat template's (tools and a forced call's opening
    included), its prompt's, or as sent; cut to the last
    ``truncate_prompt_tokens`` (the first with ``truncate_right``). Past
    ``prompt_limit`` tokens PromptTooLong (without reading the rest), unless
    truncate_prompt_tokens keeps only a part: then the whole text is read
    (server.max_body_bytes bounds it)."""
    keep = req.sampling.truncate_prompt_tokens  # vLLM's: the prompt's last N tokens (first N: right)
    limit = prompt_limit if keep is None else None
    if req.prompt_token_ids is not None:
        ids, param = list(req.prompt_token_ids), "prompt"
    elif req.messages is not None:
        ids = tokenization.apply_chat_template(req.messages, req.add_generation_prompt, limit,
                                               req.continue_final_message, tools=req.tools,
                                               assistant_prefix=req.assistant_prefix, tool_format=req.tool_format,
                                               template_kwargs=req.chat_template_kwargs)
        ids, param = list(tokenization.with_special_tokens(ids) if req.add_special_tokens else ids), "messages"
    elif req.prompt is not None:
        ids, param = list(tokenization.encode_text(req.prompt, req.add_special_tokens is not False, limit)), "prompt"
    else:
        raise ValueError("none of prompt, prompt_token_ids or messages is set")
    return (ids if keep is None else ids[:keep] if req.sampling.truncate_right else ids[-keep:]), \
        req.prompt_param or param

def too_long(num_tokens: int, limit: int, is_lower_bound: bool = False) -> str:
    """The refusal of a prompt of ``num_tokens`` (at least, when counting stopped early)."""
    count = f"at least {num_tokens}" if is_lower_bound else f"{num_tokens}"
    return f"the prompt has {count} tokens; this server's context is {limit} tokens, prompt and output together"


def _param_of(req: NewRequest) -> str:
    return req.prompt_param or ("messages" if req.messages is not None else "prompt")


def failed(req: NewRequest, message: str, param: str | None, code: str | None = None) -> Failed:
    return Failed(request_id=req.request_id, status=400, message=message, param=param, code=code)


def load_preparer(info: ModelInfo, limits: MediaLimits | None = None) -> Any:
    """The preparer for the model: a VL preparer for a multimodal model, else
    the text ``Preparer``."""
    from mstar_actors.tokenization import Tokenization

    from mstar_actors.runner.grammar import GrammarCompiler, tokenizer_info

    tokenization = Tokenization(info.model_dir)
    grammars = GrammarCompiler(tokenizer_info(tokenization.tokenizer, info.vocab_size, info.eos_token_ids))
    if info.is_multimodal:
        preparer = MEDIA_PREPARERS.get(info.architecture, QwenVLPreparer)
        return preparer(Path(info.model_dir), tokenization, info.media_token_ids, limits or MediaLimits(),
                        prompt_limit=info.max_model_len, grammars=grammars)
    return Preparer(tokenization, info.max_model_len, grammars)


# --------------------------------------------------------------------------
# Qwen2.5-VL
# --------------------------------------------------------------------------


def load_image_processor(model_dir: Path) -> Any:
    """The model's image processor (Pillow backend: it needs no torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if (Path(model_dir) / "preprocessor_config.json").is_file():
        return Qwen2VLImageProcessorPil.from_pretrained(str(model_dir), local_files_only=True)
    return Qwen2VLImageProcessorPil()


class MediaPreparer:
    """What every media preparer shares: chat template, each part's
    ``_process`` (the subclass's decode and processor), the placeholder
    expansion and the refusals, for one request at a time. Read-only after
    construction, so any number of threads may call ``draft`` at once.

    A subclass sets ``MEDIA_KINDS`` (the kinds it takes; other parts are
    refused naming the part), ``placeholders`` (kind -> token id) and
    ``_process``."""

    PREPROCESS_PARALLEL = True
    PREPARES_MEDIA = True
    MEDIA_KINDS: tuple[str, ...] = ()

    def __init__(self, tokenization: Any, limits: MediaLimits, placeholders: dict[str, int],
                 prompt_limit: int | None = None, grammars: Any = None):
        self.tokenization = tokenization
        self.text = Preparer(tokenization, prompt_limit, grammars)  # text-only requests, and the checks
        self.limits = limits
        self.placeholders = dict(placeholders)

    def _process(self, ref: MediaRef, fetched: dict[str, bytes], abandoned: Callable[[], bool]) -> MediaDraft:
        raise NotImplementedError

    def _processed(self, ref: MediaRef, fetched: dict[str, bytes], abandoned: Callable[[], bool]) -> MediaDraft:
        """``_process``; a processor's refusal of the item (Qwen's aspect ratio
        past 200, say) is the item's 400, named by its part."""
        try:
            return self._process(ref, fetched, abandoned)
        except MediaError:
            raise
        except ValueError as err:
            raise MediaError(ref.param, f"this {ref.kind} can't be prepared for the model: {err}") from None

    # ---- the one entry point -----------------------------------------------

    def draft(self, req: NewRequest, fetched: dict[str, bytes], *,
              abandoned: Callable[[], bool] = lambda: False) -> Draft | Failed:
        """``req``'s prompt and media; ``abandoned`` is asked before each item and at each frame of a video (a
        request whose client left stops there: six large images, a long clip, held the pool's thread seconds)."""
        if (refusal := self.text.check_structured(req)) is not None:  # the engine's compiler is thread-safe
            return refusal
        try:
            self._check_no_placeholder_text(req)
            refs = collect_media(req, self.limits, self.MEDIA_KINDS)
            if not refs:
                return self.text.draft(req, fetched)  # text only: the plain path
            media = []
            for ref in refs:
                if abandoned():
                    raise Abandoned()
                media.append(self._processed(ref, fetched, abandoned))
            token_ids, media = self._expand(self._template_ids(req), media, refs)
        except MediaError as err:
            return failed(req, str(err), err.param)
        except Abandoned:
            return failed(req, "abandoned during its draft: its client left", None)
        except PromptTooLong as err:
            return failed(req, too_long(err.min_tokens, err.limit, is_lower_bound=True), "messages",
                          code="context_length_exceeded")
        except TemplateRefused as err:
            return failed(req, f"messages: {err}", "messages")
        except Exception as err:  # the client's input broke a processor: its request alone fails
            return failed(req, f"could not prepare the request: {type(err).__name__}: {err}", "messages")
        problem = self.text.check(token_ids)
        if problem:
            return failed(req, problem, "messages")
        prepared = Prepared(request_id=req.request_id, model=req.model, prompt_token_ids=token_ids,
                            sampling=req.sampling, arrival_time=req.arrival_time, prompt_param="messages",
                            media_digests=media_digests(media), n=req.n, cache_salt=req.cache_salt,
                            return_prompt_ids=req.return_prompt_ids)
        return Draft(prepared, media)

    # ---- tokens --------------------------------------------------------------

    def _check_no_placeholder_text(self, req: NewRequest) -> None:
        """A media placeholder written as text (or sent as its id) would read
        as a media item's place with no item (or another's): refused by the
        part that holds it."""
        ids = sorted(set(self.placeholders.values()))
        tokens = self.tokenization.tokenizer.convert_ids_to_tokens(ids)
        parts = part_names(self.placeholders, " / ")
        if req.prompt_token_ids is not None and (hit := set(ids) & set(req.prompt_token_ids)):
            raise MediaError("prompt", f"holds token id {min(hit)}, the model's media placeholder; media go in chat "
                                       f"{parts} parts")
        if req.prompt is not None and (token := next((t for t in tokens if t in req.prompt), None)) is not None:
            raise MediaError("prompt", f"holds {token}, the model's media placeholder; media go in chat "
                                       f"{parts} parts")
        for i, message in enumerate(req.messages or []):
            if isinstance(message.content, str):
                runs = [[(f"messages[{i}].content", message.content)]]
            else:  # a message's text parts side by side, as the template joins them (a media part between parts)
                runs, last = [], None
                for j, p in enumerate(message.content):
                    if p.type != "text":
                        last = None
                        continue
                    if last is None:
                        runs.append(last := [])
                    last.append((f"messages[{i}].content[{j}].text", p.text or ""))
            for run in runs:
                text = "".join(t for _, t in run)
                at = min(((k, t) for t in tokens if (k := text.find(t)) >= 0), default=None)
                if at is None:
                    continue
                start, token = at
                for param, piece in run:  # the part the placeholder starts in
                    if start < len(piece):
                        break
                    start -= len(piece)
                where = ("holds" if start + len(token) <= len(piece) else
                         "and the text parts after it, which the chat template joins, spell")
                raise MediaError(param, f"{where} {token}, the model's media placeholder; send media as "
                                        f"{parts} parts, not as that text")

    def _template_ids(self, req: NewRequest) -> list[int]:
        ids = self.tokenization.apply_chat_template(
            req.messages or [], req.add_generation_prompt, self.text.prompt_limit, req.continue_final_message,
            tools=req.tools, assistant_prefix=req.assistant_prefix, tool_format=req.tool_format,
            template_kwargs=req.chat_template_kwargs, media_parts=True)
        return self.tokenization.with_special_tokens(ids) if req.add_special_tokens else ids

    def _expand(self, ids: list[int], media: list[MediaDraft], refs: list[MediaRef]) -> tuple[list[int], list[MediaDraft]]:
        """Replace each placeholder token by its item's ``num_tokens`` copies and
        record where each item's rows start; returns the ids and the items."""
        placeholders = self.placeholders
        found = [i for i, t in enumerate(ids) if t in placeholders.values()]
        if len(found) != len(media):
            raise MediaError(refs[0].param, f"the chat template wrote {len(found)} media placeholders for "
                                            f"{len(media)} media parts; the model's template must write one each")
        out: list[int] = []
        start = 0
        for pos, item, ref in zip(found, media, refs):
            if ids[pos] != placeholders[item.kind]:
                raise MediaError(ref.param, f"the chat template's placeholder here is not a {item.kind} token")
            out += ids[start:pos]
            item.token_offset = len(out)
            out += [ids[pos]] * item.num_tokens
            start = pos + 1
        return out + ids[start:], media


class QwenVLPreparer(MediaPreparer):
    """Chat template, image/video decode, the processor's patch rows and the
    placeholder expansion (``MediaPreparer``)."""

    MEDIA_KINDS = VISION_KINDS

    def __init__(self, model_dir: Path, tokenization: Any, media_token_ids: dict[str, int], limits: MediaLimits,
                 image_processor: Any = None, prompt_limit: int | None = None, grammars: Any = None):
        super().__init__(tokenization, limits, {k: media_token_ids[k] for k in VISION_KINDS}, prompt_limit, grammars)
        self.image_token_id = media_token_ids["image"]
        self.video_token_id = media_token_ids["video"]
        self.image_processor = image_processor or load_image_processor(model_dir)
        ip = self.image_processor
        self.patch_size, self.merge_size, self.temporal_patch_size = ip.patch_size, ip.merge_size, ip.temporal_patch_size
        self.min_pixels, self.max_pixels = ip.size["shortest_edge"], ip.size["longest_edge"]

    # ---- media ---------------------------------------------------------------

    def _process(self, ref: MediaRef, fetched: dict[str, bytes], abandoned: Callable[[], bool]) -> MediaDraft:
        if is_frame_list(ref):  # vLLM's video as its JPEG frames
            video, data = decode_frame_list(ref, self.limits), ref.url.encode()
            item = self._video(video.frames, video.fps)
        else:
            data = fetched[ref.param] if ref.param in fetched else read_local(ref, self.limits)
            if ref.kind == "image":
                item = self._image(decode_image(data, ref, self.limits))
            else:
                video = decode_video(data, ref, self.limits, abandoned=abandoned)
                item = self._video(video.frames, video.fps)
        item.source_digest = source_digest(data) + (b"low" if ref.detail == "low" else b"")  # other pixels
        return item

    def _image(self, image: Any) -> MediaDraft:
        out = self.image_processor(images=[image], return_tensors="pt")
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return MediaDraft("image", out["pixel_values"].float().contiguous(), (t, h, w), 0,
                          t * h * w // self.merge_size**2)

    def _video(self, frames: Any, fps: float) -> MediaDraft:
        pixel_values, grid = video_patches(frames, self.image_processor, self.min_pixels, self.max_pixels)
        t, h, w = grid
        return MediaDraft("video", pixel_values, grid, 0, t * h * w // self.merge_size**2,
                          second_per_grid_t=self.temporal_patch_size / fps)


def media_parts(messages: list[ChatMessage] | None) -> list[tuple[str, str]]:
    """``(param, type)`` of each content part that is not text, in order, e.g.
    ``("messages[0].content[1].image_url", "image_url")``."""
    return [(f"messages[{i}].content[{j}].{part.type}", part.type) for i, message in enumerate(messages or [])
            for j, part in enumerate(message.content if isinstance(message.content, list) else [])
            if part.type != "text"]


def first_media_part(messages: list[ChatMessage] | None) -> tuple[str, str] | None:
    """The first of ``media_parts``; None for text only."""
    return next(iter(media_parts(messages)), None)


def _media_refused(req: NewRequest) -> Failed | None:
    """A media part sent to the text path (a text-only model), named by its part."""
    if (media := first_media_part(req.messages)) is None:
        return None
    param, part = media
    readers = [arch for arch, preparer in MEDIA_PREPARERS.items() if MEDIA_PART_TYPES.get(part) in preparer.MEDIA_KINDS]
    return failed(req, f"{param}: this model reads text only; {part} parts are for a checkpoint of a media "
                       f"architecture ({', '.join(readers)})", param)


def media_digests(media: list[MediaDraft]) -> tuple[str, ...]:
    """Each item's blake2b over its kind, grid, place in the prompt, frame timing
    and source bytes (its pixel rows when it has no ``source_digest``): equal
    only for the same media in the same place. The scheduler keys the blocks
    from an item's first token on by it (placeholder tokens are equal for any
    image, their KV is not), the blocks before it by the items before it alone:
    a turn that adds an image keeps the earlier turns' hits. Runs on the pool's
    thread."""
    import hashlib

    digests = []
    for item in media:
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{item.kind}|{item.grid_thw}|{item.token_offset}|{item.num_tokens}|{item.second_per_grid_t!r}|".encode())
        if item.source_digest:
            h.update(b"bytes:" + item.source_digest)
        else:
            h.update(item.pixel_values.contiguous().numpy())  # no copy; hashlib releases the GIL on large buffers
        digests.append(h.hexdigest())
    return tuple(digests)


def video_patches(frames: Any, image_processor: Any, min_pixels: int, max_pixels: int) -> tuple[Any, tuple[int, int, int]]:
    """Qwen2-VL's video layout without torchvision: every frame resized to one
    ``smart_resize`` size, padded to a whole temporal patch by repeating the
    last frame, laid out as (t, h/m, w/m, m, m, C, tps, p, p) rows of raw
    uint8 levels. The vision tower rescales and normalizes them on the rank
    with the image processor's constants (``models.vision.PixelNorm``), so
    the arena and the copies carry a quarter of the bytes.

    The resize is transformers' video processor's: torchvision's resize of a
    uint8 CPU tensor is ``interpolate(bicubic, antialias=True)`` on uint8.
    Pillow's bicubic (the image processor's) differs from it by at most 2 of
    255 levels in under 1% of values and costs ~10 ms per 8 frames of
    320x240 where this takes ~1.5 ms."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ip = image_processor
    _, height, width, _ = frames.shape
    size = smart_resize(height, width, factor=ip.patch_size * ip.merge_size, min_pixels=min_pixels, max_pixels=max_pixels)
    return patch_frames(frames, size, ip.patch_size, ip.merge_size, ip.temporal_patch_size)


def patch_frames(frames: Any, size: tuple[int, int], p: int, m: int, tps: int) -> tuple[Any, tuple[int, int, int]]:
    """``video_patches``' resize (to ``size``, when it differs), temporal padding
    and (t, h/m, w/m, m, m, C, tps, p, p) layout of raw uint8 rows."""
    import torch
    from torch.nn import functional

    num_frames, height, width, _ = frames.shape
    rh, rw = size
    x = torch.from_numpy(frames)  # (T, H, W, C)
    if (rh, rw) != (height, width):  # channels-last in memory, which is interpolate's fast uint8 path
        x = functional.interpolate(x.permute(0, 3, 1, 2), size=(rh, rw), mode="bicubic", antialias=True)
        x = x.permute(0, 2, 3, 1)
    if num_frames % tps:
        x = torch.cat([x, x[-1:].expand(tps - num_frames % tps, -1, -1, -1)])
    t, gh, gw = x.shape[0] // tps, rh // p, rw // p
    cells = x.reshape(t, tps, gh // m, m, p, gw // m, m, p, 3).permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return cells.reshape(t * gh * gw, 3 * tps * p * p), (t, gh, gw)  # one uint8 gather


# --------------------------------------------------------------------------
# Qwen3.5
# --------------------------------------------------------------------------

QWEN3_5_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"


def load_video_processor(model_dir: Path) -> Any:
    """Qwen3-VL's video processor settings (sizes, patches, normalization); its
    torchvision pipeline is not run: ``qwen3_5_video_patches`` does its work."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if (Path(model_dir) / "video_preprocessor_config.json").is_file():
        return Qwen3VLVideoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    return Qwen3VLVideoProcessor()


def video_pixel_constants(video_processor: Any) -> tuple[list[float], list[float], float]:
    """(mean, std, rescale) for ``PixelNorm`` that reproduce the video processor's
    fused normalization, ``(x - mean / rescale) / (std / rescale)``, in float32."""
    import torch

    vp = video_processor
    # On the CPU explicitly: the loader builds the model under a meta device.
    mean = (torch.tensor(vp.image_mean, device="cpu") * (1.0 / vp.rescale_factor)).tolist()
    std = (torch.tensor(vp.image_std, device="cpu") * (1.0 / vp.rescale_factor)).tolist()
    return mean, std, 1.0


def qwen3_5_video_patches(frames: Any, video_processor: Any) -> tuple[Any, tuple[int, int, int]]:
    """Qwen3-VL's video processor without torchvision: its ``smart_resize``
    (over the whole clip's pixel budget, with the per-frame cap when the
    processor sets ``cap_pixels_per_frame``), then ``video_patches``' resize
    and layout, as raw uint8 rows."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    vp = video_processor
    num_frames, height, width, _ = frames.shape
    factor = vp.patch_size * vp.merge_size
    min_pixels, max_pixels = vp.size["shortest_edge"], vp.size["longest_edge"]
    if vp.cap_pixels_per_frame:
        per_frame = max(min(vp.max_video_tokens * factor * factor, max_pixels // num_frames), int(min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    size = smart_resize(max(num_frames, vp.temporal_patch_size), height, width, temporal_factor=vp.temporal_patch_size,
                        factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return patch_frames(frames, size, vp.patch_size, vp.merge_size, vp.temporal_patch_size)


def frame_timestamps(num_frames: int, fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Each temporal patch's time as the processor writes it: the mean of its
    first and last frame's times, the clip padded with its last frame."""
    indices = list(range(num_frames))
    indices += [num_frames - 1] * (-num_frames % temporal_patch_size)
    times = [i / fps for i in indices]
    return tuple((times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size))


class Qwen3_5VLPreparer(QwenVLPreparer):
    """Qwen3.5's preparation: images as Qwen2.5-VL's (the same image processor,
    with 16 px patches); a video as the processor writes it, one
    ``<t seconds><vision_start><video_pad>*n<vision_end>`` group per temporal
    patch in place of the template's placeholder, each group its own media item
    (grid ``(1, h, w)``) so every placeholder run is contiguous. Frames are
    the server's (``limits.video_fps``), resized and patched as Qwen3-VL's
    video processor does. Read-only after construction, like its parent."""

    def __init__(self, model_dir: Path, tokenization: Any, media_token_ids: dict[str, int], limits: MediaLimits,
                 image_processor: Any = None, prompt_limit: int | None = None, grammars: Any = None,
                 video_processor: Any = None):
        super().__init__(model_dir, tokenization, media_token_ids, limits, image_processor, prompt_limit, grammars)
        self.video_processor = video_processor or load_video_processor(model_dir)
        tokenizer = tokenization.tokenizer
        self.vision_start_id, self.vision_end_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))

    def _video(self, frames: Any, fps: float) -> MediaDraft:
        pixel_values, grid = qwen3_5_video_patches(frames, self.video_processor)
        t, h, w = grid
        tps = self.video_processor.temporal_patch_size
        return MediaDraft("video", pixel_values, grid, 0, t * h * w // self.video_processor.merge_size**2,
                          second_per_grid_t=tps / fps, timestamps=frame_timestamps(frames.shape[0], fps, tps))

    def _expand(self, ids: list[int], media: list[MediaDraft], refs: list[MediaRef]) -> tuple[list[int], list[MediaDraft]]:
        """The parent's expansion, then each video's run becomes its groups of frames."""
        ids, media = super()._expand(ids, media, refs)
        out: list[int] = []
        items: list[MediaDraft] = []
        cursor = 0
        for item in media:
            out += ids[cursor:item.token_offset]
            cursor = item.token_offset + item.num_tokens
            if item.kind != "video":
                item.token_offset = len(out)
                out += [self.image_token_id] * item.num_tokens
                items.append(item)
                continue
            # The template's own <vision_start>..<vision_end> around the placeholder goes, every group carrying
            # its own, as Qwen3-VL's processor writes it (transformers' since 5.25)
            if out and out[-1] == self.vision_start_id and cursor < len(ids) and ids[cursor] == self.vision_end_id:
                out.pop()
                cursor += 1
            t, h, w = item.grid_thw
            per_frame = item.num_tokens // t
            for i, (rows, stamp) in enumerate(zip(item.pixel_values.split(h * w), item.timestamps, strict=True)):
                out += self.tokenization.tokenizer.encode(f"<{stamp:.1f} seconds>", add_special_tokens=False)
                out.append(self.vision_start_id)
                items.append(MediaDraft("video", rows, (1, h, w), len(out), per_frame, item.second_per_grid_t,
                                        (stamp,), item.source_digest))
                out += [self.video_token_id] * per_frame
                out.append(self.vision_end_id)
        return out + ids[cursor:], items


# --------------------------------------------------------------------------
# Qwen2-Audio
# --------------------------------------------------------------------------

QWEN2_AUDIO_ARCHITECTURE = "Qwen2AudioForConditionalGeneration"


class AudioPreparer(MediaPreparer):
    """Qwen2-Audio's preparation: each ``audio_url`` / ``input_audio`` part
    decoded and resampled to the feature extractor's rate (``decode_audio``),
    its log-mel frames (the extractor's, padded to its chunk as
    ``Qwen2AudioProcessor`` asks), and the template's ``<|AUDIO|>`` expanded
    to the processor's count of audio tokens. An item carries only the frames
    its valid rows read (``models.qwen2_audio``). A clip longer than the
    extractor's chunk is refused (the processor would cut it silently)."""

    MEDIA_KINDS = AUDIO_KINDS

    def __init__(self, model_dir: Path, tokenization: Any, media_token_ids: dict[str, int], limits: MediaLimits,
                 feature_extractor: Any = None, prompt_limit: int | None = None, grammars: Any = None):
        super().__init__(tokenization, limits, {"audio": media_token_ids["audio"]}, prompt_limit, grammars)
        self.model_dir = Path(model_dir)  # a clip process loads its own extractor from here
        self.feature_extractor = feature_extractor or load_feature_extractor(model_dir)
        fe = self.feature_extractor
        self.sampling_rate, self.max_frames = fe.sampling_rate, fe.nb_max_frames
        self.max_seconds = min(limits.max_audio_seconds, fe.n_samples / fe.sampling_rate)

    processes: Any = None  # ``clip_processes.ClipProcesses`` once ``start_processes`` ran

    def start_processes(self, num: int, run_id: str | None = None, cpus: list[list[int]] | None = None) -> None:
        """Prepare clips in ``num`` processes of their own (``ClipProcesses``:
        each loads the feature extractor once, started and warmed now), their
        shared memory named under ``run_id`` (default: an id of its own),
        process i pinned to ``cpus[i]`` where given; ``stop_processes`` ends them."""
        from mstar_actors import rundir
        from mstar_actors.prepare.clip_processes import ClipProcesses

        fe = self.feature_extractor
        self.processes = ClipProcesses(self.model_dir, num, run_id or rundir.new_run_id(),
                                       frame_bytes=self.max_frames * fe.feature_size * 4, cpus=cpus)

    def stop_processes(self) -> None:
        if self.processes is not None:
            self.processes.close()
            self.processes = None

    def _process(self, ref: MediaRef, fetched: dict[str, bytes], abandoned: Callable[[], bool]) -> MediaDraft:
        data = fetched[ref.param] if ref.param in fetched else read_local(ref, self.limits)
        args = (data, ref.param, self.limits, self.sampling_rate, self.max_seconds)
        if self.processes is None:
            rows, num_frames, num_tokens, digest = prepare_clip(self.feature_extractor, *args)
        else:
            rows, num_frames, num_tokens, digest = self.processes.prepare(*args)
        item = MediaDraft("audio", torch_rows(rows), (1, num_frames, 1), 0, num_tokens)
        item.source_digest = digest
        return item


def torch_rows(rows: Any) -> Any:
    import torch

    return torch.from_numpy(rows).contiguous()


# The media architectures' preparers (``load_preparer``), by config.json's architecture
MEDIA_PREPARERS: dict[str, type[MediaPreparer]] = {
    "Qwen2_5_VLForConditionalGeneration": QwenVLPreparer,
    QWEN3_5_ARCHITECTURE: Qwen3_5VLPreparer,
    QWEN2_AUDIO_ARCHITECTURE: AudioPreparer,
}
