"""Every message the actors exchange: the protocol in one file.

One tagged union per channel, named ``<From>To<To>``. A channel carries only
its union, decoded by one typed decoder made once (see ``transport.codec``);
an unknown tag is an error naming the channel, never skipped.

Value structs inside messages use ``array_like=True`` (positional msgpack
arrays, no field names on the wire) and ``omit_defaults=True``; the tagged
messages themselves are maps (msgspec needs one layout per union). Adding a
field: append it at the end with a default.

Channels::

    frontend --FrontendToPrepare--> prepare --PrepareToConductor--> conductor
    conductor --ConductorToFrontend--> frontend
    conductor --ConductorToWorker--> worker (broadcast, one ring per rank)
    worker --WorkerToConductor--> conductor (one ring per rank)
    launcher --LauncherToActor--> every actor;  every actor --ActorToLauncher--> launcher

With ``server.api_server_count`` frontends, each has its own pair of frontend
rings: the conductor answers the frontend a request id names (``frontend_of``)
and sends the rest to all.
"""

from __future__ import annotations

import uuid
from typing import Literal

import msgspec

Struct = msgspec.Struct
_HOT = dict(array_like=True, omit_defaults=True)


# --------------------------------------------------------------------------
# Shared value types (untagged: they travel inside tagged messages)
# --------------------------------------------------------------------------


class TensorRef(Struct, frozen=True, **_HOT):
    """A tensor stored in a shared-memory arena (see ``transport.arena``).

    The reader maps it without a copy and must release it exactly once. A
    ref whose ``segment`` is ``RANK_MEMORY`` names instead a rank's private
    copy, by the key ``offset`` (see ``StepPlan.copy_media``).
    """

    segment: str
    offset: int
    nbytes: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]


class MediaItem(Struct, frozen=True, **_HOT):
    """One image, video or audio clip of a request, prepared by the model's processor.

    ``pixel_values`` (the processor's patch rows; an audio clip's log-mel
    frames, one row per frame) lives in the tensor arena; the prompt holds
    ``num_tokens`` placeholder tokens from ``token_offset`` that the worker
    replaces with the encoder's output rows inside the step. ``grid_thw`` is
    the (temporal, height, width) patch grid; for audio ``(1, num_frames, 1)``,
    its valid mel frames (``models.qwen2_audio``).
    """

    kind: Literal["image", "video", "audio"]
    pixel_values: TensorRef
    grid_thw: tuple[int, int, int]
    token_offset: int
    num_tokens: int
    second_per_grid_t: float = 0.0  # video: seconds per temporal patch (multimodal rotary positions)


RANK_MEMORY = "rank-memory"  # TensorRef.segment of a rank's private copy


class MediaCopy(Struct, frozen=True, **_HOT):
    """Copy arena tensor ``ref`` into rank memory as key ``key``, then release
    the arena block (see ``StepPlan.copy_media``)."""

    key: int
    ref: TensorRef


class AdapterHostRef(Struct, frozen=True, **_HOT):
    """The adapter-reader's host copy of one adapter: a shared-memory segment
    holding a safetensors blob (see ``mstar_actors.lora.host_copy``). The
    reader owns it; ranks map it read-only while they install."""

    segment: str
    nbytes: int


class AdapterInfo(Struct, frozen=True, **_HOT):
    """A served adapter as the frontend lists it (``/v1/models``)."""

    name: str
    path: str
    digest: str


class StructuredSpec(Struct, frozen=True, **_HOT):
    """A constraint on the output (see ``mstar_actors.runner.grammar``).

    ``kind``: "json" (``spec`` is a JSON schema), "json_object" (any JSON
    object; ``spec`` unused), "regex", "choice" (a JSON list of strings),
    "grammar" (EBNF/GBNF as the grammar engine reads it), "json_calls" (one
    or more values of a schema joined by a separator, an optional end after
    the last: ``spec`` is ``{"schema": ..., "separator": ..., "end": ...}``,
    a forced reply's parallel tool calls), "xml_calls" (a forced reply's
    calls of the ``qwen3_coder`` format: ``{"functions": [{"name": ...,
    "parameters": ...}], "separator": ..., "end": ..., "repeat": ...}``),
    "tagged_calls" (an ``auto`` reply's calls of strict tools, free text
    between: ``tool_calls.strict_calls_spec``).
    ``param``: the body field it came from, which a refusal of the spec
    names.

    ``reasoning``: the ``(<think>, </think>)`` token ids of a model whose chat
    replies reason first (``model.reasoning_parser``): the constraint holds
    from the token after ``</think>``; before it the reply is free. A reply
    ``opened`` inside its reasoning (its prompt opened ``<think>``) waits for
    ``</think>``; else its first token may be ``<think>`` (then it waits) or
    the constraint's own. Empty: constrained from the first token.
    """

    kind: Literal["json", "json_object", "regex", "choice", "grammar", "json_calls", "xml_calls", "tagged_calls"]
    spec: str = ""
    param: str = ""
    reasoning: tuple[int, ...] = ()
    opened: bool = False


class SamplingParams(Struct, frozen=True, **_HOT):
    """Per-request sampling, already validated (see ``mstar_actors.sampling_params``).

    ``top_k == 0`` and ``top_p == 1.0`` and ``min_p == 0.0`` mean "off".
    ``temperature == 0.0`` means greedy. ``logprobs`` is None for none, else
    the number of top alternatives returned with each sampled token (0 = only
    the sampled token's own logprob).

    Logits processors, applied on every rank before sampling (``runner.sampling``):
    ``logit_bias`` adds (token id, bias) pairs; ``allowed_token_ids`` keeps only
    those tokens (empty = all); ``bad_words_token_ids`` bans each sequence's last
    token where the output ends with the rest of it; ``min_token_stop_ids`` (EOS
    and ``stop_token_ids``, filled by the frontend) are masked until the output
    holds ``min_tokens`` tokens. ``truncate_prompt_tokens`` keeps the prompt's
    last N tokens, its first N with ``truncate_right`` (prepare applies it). ``structured`` constrains the output
    to a grammar (None: unconstrained). ``prompt_logprobs`` (None: none) asks
    for each prompt token's logprob given the tokens before it, with that many
    top alternatives: they come with the first sampled token
    (``SampledToken.prompt_logprobs``), and such a prompt takes no prefix-cache
    hit (a cached position's logits are never computed).
    ``thinking_budget`` (vLLM's ``thinking_token_budget``; None: none) holds
    a reasoning to that many tokens: counted from the ``<think>`` of
    ``think_ids`` (``(<think>, </think>)``, filled by the frontend) that the
    prompt left open or the output opened, ``</think>`` is the only token
    allowed once they are spent.

    ``max_tokens`` is the client's cap on the output: a prompt that leaves
    less room in ``max_model_len`` (or the KV cache) is refused, as OpenAI and
    vLLM refuse it, unless ``cut_to_context``: the cap is a default the client
    did not send (a chat request's is the whole context), cut to what the
    prompt leaves.
    """

    max_tokens: int = 16
    cut_to_context: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0
    min_token_stop_ids: tuple[int, ...] = ()
    truncate_prompt_tokens: int | None = None
    truncate_right: bool = False
    prompt_logprobs: int | None = None
    thinking_budget: int | None = None
    think_ids: tuple[int, ...] = ()


class ContentPart(Struct, frozen=True, omit_defaults=True):
    """One part of a chat message's content (OpenAI content-part list)."""

    type: str  # "text" | "image_url" | "video_url" | "audio_url" | "input_audio" (its data as a data: URL)
    text: str | None = None
    url: str | None = None
    detail: str | None = None  # an image_url's "low" (a 512 x 512 version, fewer tokens) or "high" / "auto"


class ToolCall(Struct, frozen=True, omit_defaults=True):
    """A function call of an assistant message in the history; ``arguments``
    is the JSON object text OpenAI sends (templates get it decoded)."""

    id: str
    name: str
    arguments: str = "{}"


class ChatMessage(Struct, frozen=True, omit_defaults=True):
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str | list[ContentPart] = ""
    tool_calls: tuple[ToolCall, ...] = ()  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    name: str | None = None
    reasoning_content: str | None = None  # assistant: its reasoning, for templates that show it again


class TopLogprob(Struct, frozen=True, **_HOT):
    token_id: int
    logprob: float


class PromptLogprob(Struct, frozen=True, **_HOT):
    """A prompt token's logprob given the tokens before it (raw, as sampled
    logprobs are), and the top alternatives there."""

    token_id: int
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()
    rank: int = 0  # 1 + the tokens more likely there (vLLM's prompt_logprobs show it)


class SampledToken(Struct, frozen=True, **_HOT):
    """One token sampled for one request in one step. The first of a request
    that asked for ``SamplingParams.prompt_logprobs`` carries them, for its
    prompt's tokens after the first."""

    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()
    # The row's own logits processors (allowed_token_ids, bad words, min_tokens'
    # stop ban, on top of its grammar) left no token: ``token_id`` stands in, the request fails.
    dead: bool = False
    prompt_logprobs: tuple[PromptLogprob, ...] = ()


# --------------------------------------------------------------------------
# frontend -> prepare
# --------------------------------------------------------------------------


class NewRequest(Struct, frozen=True, tag=True, omit_defaults=True):
    """A validated client request. Exactly one of prompt / prompt_token_ids /
    messages is set. ``model`` is the served name: the base model or an adapter.
    It is prepared once; the conductor runs its ``n`` choices as sequences
    named ``choice_ids(request_id, n)``, each output names its choice."""

    request_id: str
    model: str
    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    arrival_time: float = 0.0
    n: int = 1  # choices sampled from the one prepared prompt
    # OpenAI ``tools`` as the chat template takes them (``[{"type": "function",
    # "function": {...}}]``); None: render no tools.
    tools: list[dict] | None = None
    # Text the assistant turn starts with, after the generation prompt: the
    # opening of a forced tool call, so the model writes only its JSON.
    assistant_prefix: str = ""
    # The format tool calls are read back in (``tool_calls.PARSERS``): a template that writes no tools or calls
    # gets them written in it (``tool_calls.with_tool_polyfills``).
    tool_format: str = "llama3_json"
    continue_final_message: bool = False  # the template leaves the last (assistant) message open
    # The tokenizer's special tokens (its BOS) on a text prompt, or (vLLM's, off by default there) on the chat
    # template's; None: a text prompt's only. A prompt of token ids is taken as sent.
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict | None = None  # more variables for the chat template (vLLM's field)
    prompt_param: str = ""  # the body field a refused prompt is named by ("input" for speech); "": prompt / messages
    cache_salt: str = ""  # vLLM's: prefix-cache blocks are shared only between requests of the same salt
    return_prompt_ids: bool = False  # vLLM's return_token_ids: each choice's first delta carries the prompt's ids


def new_request_id(kind: str, frontend: int = 0) -> str:
    """A new engine request id, ``{kind}-{32 hex}``; frontend ``k > 0``'s
    (``server.api_server_count``) ``{kind}-f{k}-{32 hex}``, so the conductor
    answers the frontend that asked (``frontend_of``). Choice and prompt ids
    append to it."""
    tag = f"f{frontend}-" if frontend else ""
    return f"{kind}-{tag}{uuid.uuid4().hex}"


def frontend_of(request_id: str) -> int:
    """The frontend a request id names (``new_request_id``): 0 unless its
    second dash-separated part is ``f{k}``."""
    parts = request_id.split("-", 2)
    if len(parts) == 3 and 1 < len(parts[1]) <= 4 and parts[1][0] == "f" and parts[1][1:].isdigit():
        return int(parts[1][1:])
    return 0


def choice_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's ``n`` choices: its own for one, else ``id-0`` ..."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


class Abort(Struct, frozen=True, tag=True, omit_defaults=True):
    """Stop a request (every choice) or one choice: a client disconnect or a
    stop-string match. Idempotent; an abort of an unknown or finished request
    is a no-op."""

    request_id: str


class Shutdown(Struct, frozen=True, tag=True, omit_defaults=True):
    reason: str = ""


class LoadAdapter(Struct, frozen=True, tag=True, omit_defaults=True):
    """Runtime load (``POST /v1/load_lora_adapter``); answered by AdapterUpdate.
    A load under a served (or loading) name is refused unless ``replace``
    (vLLM's ``load_inplace``): then it replaces it, checked as its new file."""

    request_id: str
    name: str
    path: str
    replace: bool = False


class UnloadAdapter(Struct, frozen=True, tag=True, omit_defaults=True):
    """Runtime unload; requests already running on it finish first."""

    request_id: str
    name: str


FrontendToPrepare = NewRequest | Abort | LoadAdapter | UnloadAdapter | Shutdown


# --------------------------------------------------------------------------
# prepare -> conductor
# --------------------------------------------------------------------------


class Prepared(Struct, frozen=True, tag=True, omit_defaults=True):
    """Model inputs for one request, sent once ready (text never waits for media)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    # The body field the prompt came from ("prompt" or "messages"): a later
    # refusal (e.g. by the scheduler) names it as the OpenAI error's ``param``.
    prompt_param: str = "prompt"
    media: list[MediaItem] = []  # in prompt order; empty for text
    # Each media item's digest (its source or pixel rows, grid, place): the
    # scheduler keys the blocks from an item's first token on by it, so
    # placeholder blocks computed for one image are never reused for another,
    # and those before it are keyed by the items before it alone.
    media_digests: tuple[str, ...] = ()
    n: int = 1  # NewRequest.n: choices that share this prompt and its media
    cache_salt: str = ""  # NewRequest.cache_salt: the conductor keys the prefix cache by it too
    return_prompt_ids: bool = False  # NewRequest.return_prompt_ids


class Failed(Struct, frozen=True, tag=True, omit_defaults=True):
    """A request that failed alone. ``status`` is the HTTP status the client
    gets (4xx for its own input, 5xx for ours); ``code`` is OpenAI's code."""

    request_id: str
    status: int
    message: str
    error_type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


PrepareToConductor = Prepared | Abort | Failed | LoadAdapter | UnloadAdapter | Shutdown


# --------------------------------------------------------------------------
# conductor -> frontend
# --------------------------------------------------------------------------


class TokenDelta(Struct, frozen=True, tag=True, omit_defaults=True):
    """New tokens of one request, in order. The frontend detokenizes."""

    request_id: str
    tokens: list[SampledToken]
    # The prompt's length and the prefix cache's hit on a choice's first delta
    # (0 on later ones): the frontend reports usage for a choice it ended
    # itself (stop string) without waiting for a Finished.
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # On a choice's first delta, the conductor's clock: from its arrival to its first scheduled step, and
    # from there to this token (vLLM's queue and prefill times).
    queued_s: float = 0.0
    prefill_s: float = 0.0
    # On a choice's first delta where the request asked (``return_prompt_ids``): the ids the model was given, as
    # prepare made them (a chat template's rendering, media placeholders expanded, truncate_prompt_tokens' cut).
    prompt_token_ids: list[int] | None = None
    # On a choice's first delta: the prompt tokens looked up in the prefix cache (vLLM's prefix-cache queries;
    # 0 where the cache was not read: caching off, or prompt logprobs asked for)
    num_queried_tokens: int = 0


class Finished(Struct, frozen=True, tag=True, omit_defaults=True):
    """The request ended normally; no more deltas follow.

    ``finish_reason`` is "stop" (EOS or a stop token) or "length"
    (max_tokens or the model's context) or "abort".
    """

    request_id: str
    finish_reason: Literal["stop", "length", "abort"]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    stop_token_id: int | None = None
    num_preemptions: int = 0  # times the choice was preempted (recomputed)


class EngineStats(Struct, frozen=True, tag=True, omit_defaults=True):
    """The conductor's gauges, sent after each step that changed them."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preemptions: int = 0
    # Running sequences with no output token yet (their prefill in flight): a
    # frontend's choices sent with no output, less these, wait or are on their way.
    num_starting: int = 0
    # Requests held until their adapter is installed on every rank, parked ones
    # too (included in num_waiting): a full adapter pool is backpressure, visible here.
    num_waiting_for_adapter: int = 0
    # Requests held for an adapter's slot (parked too) or a grammar's compile (included in num_waiting),
    # vLLM's "deferred" ones; the rest wait for capacity
    num_waiting_deferred: int = 0
    # Running sequences parked for their adapter's slot (included in num_running: each keeps its seat; the
    # gauges count them waiting)
    num_parked: int = 0
    # Recurrent-state slots (models with recurrent layers; 0 and 0 otherwise).
    num_state_slots_used: int = 0
    num_state_slots_total: int = 0
    # LoRA adapters (``AdapterPool.adapter_names``): those of admitted choices, and those choices wait for
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    # The tokens of each step planned since the stats before (``vllm:iteration_tokens_total``)
    step_tokens: tuple[int, ...] = ()


class AdapterUpdate(Struct, frozen=True, tag=True, omit_defaults=True):
    """The answer to a LoadAdapter / UnloadAdapter: ``status`` 200 or the
    HTTP error status with OpenAI's ``code``."""

    request_id: str
    status: int
    message: str
    code: str | None = None


class ModelsChanged(Struct, frozen=True, tag=True, omit_defaults=True):
    """Every adapter now served, after each change (a load, an unload, an adapter whose files went); the
    frontend starts from the config's adapters."""

    adapters: list[AdapterInfo]


class ContextAgreed(Struct, frozen=True, tag=True, omit_defaults=True):
    """The context the engine serves (prompt + output tokens): the launcher's
    ``ModelInfo.max_model_len`` narrowed to the KV capacity the ranks agreed
    on. Sent once, before the conductor reports ready."""

    max_model_len: int


ConductorToFrontend = (
    TokenDelta | Finished | Failed | EngineStats | AdapterUpdate | ModelsChanged | ContextAgreed | Shutdown
)


# --------------------------------------------------------------------------
# conductor -> worker (broadcast to every rank, identical bytes)
# --------------------------------------------------------------------------


class SeqStart(Struct, frozen=True, **_HOT):
    """A sequence new to the workers, or restarted after a preemption (then
    ``output_token_ids`` holds what it generated before). Workers keep it until
    it appears in ``StepPlan.finished``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = []
    # Prepared.media with each pixel_values naming the rank's copy
    # (``RANK_MEMORY``); vision rows are computed by the worker.
    media: list[MediaItem] = []
    lora_slot: int = 0  # 0: the base model; else a slot every rank acknowledged, or installs first (rows_follow)
    # The recurrent-state slot the scheduler gave it (``WorkerReady.num_state_slots``);
    # -1: the model keeps no recurrent state. The slot may have held another
    # sequence's state: ranks build this one's from its first token.
    state_slot: int = -1
    # A prefix hit of a hybrid model: the snapshot slot whose state the ranks copy
    # into ``state_slot`` before this step (-1: none; the chunk starts from token 0).
    restore_snapshot: int = -1


class ScheduledChunk(Struct, frozen=True, **_HOT):
    """Work for one sequence in one step.

    The worker feeds tokens ``all_tokens[num_computed : num_computed + num_tokens]``
    (prompt followed by outputs) at positions starting at ``num_computed``,
    writing their KV into ``block_ids`` (the full block table, in order).
    ``sample`` is true when the chunk reaches the last known token, so one new
    token is sampled and appended by every rank.
    """

    request_id: str
    num_computed: int
    num_tokens: int
    block_ids: list[int]
    sample: bool
    # A hybrid model's chunk that ends where a prompt's last full block does: the
    # ranks copy the sequence's recurrent state into this snapshot slot after the
    # step (-1: none), for later prefix hits (``SeqStart.restore_snapshot``).
    snapshot: int = -1
    # The LoRA slot the chunk's rows run on this step: the scheduler names it
    # in every chunk, since a sequence parked for adapter churn resumes on
    # whatever slot its adapter gets next (-1: the one its SeqStart named).
    lora_slot: int = -1


class StepPlan(Struct, frozen=True, tag=True, omit_defaults=True):
    """One step, final as the scheduler emits it: ranks apply ``finished``,
    then the media orders, then run ``started`` and ``scheduled``.

    Media lifetime (the scheduler owns it, see ``mstar_actors.sched.media``):
    a request's pixel tensors reach a rank once, shared by its choices, in
    ``copy_media`` of the plan that first starts one of them: each rank
    copies them into its own memory and releases the arena block at once
    (the arena reclaims FIFO, so a block held for a whole generation would
    stall every newer tensor). SeqStarts name the copies by key, a restart
    after a preemption too. ``drop_media`` frees them once the request's last
    choice ended; ``release_media`` releases unread the arena refs of a
    request that ended before any choice started.
    """

    step_id: int
    started: list[SeqStart]
    scheduled: list[ScheduledChunk]
    finished: list[str] = []  # request ids the workers forget before this step
    release_media: list[TensorRef] = []
    copy_media: list[MediaCopy] = []
    drop_media: list[int] = []  # keys of MediaCopy
    # Installs into slots whose rows this step is the last to run (a LoRA
    # turn's end, ``AdapterPool.step``): each rank queues them behind this
    # step's kernels and acknowledges them before it answers the step ahead,
    # so the conductor may plan the slot's new rows into the next step.
    install_after: list[InstallAdapter] = []


class InstallAdapter(Struct, frozen=True, tag=True, omit_defaults=True):
    """Load an adapter into a device slot on every rank. The conductor alone
    picks the slot; rows use it only after every rank's AdapterInstalled,
    unless ``rows_follow``: every rank reported keeping this adapter's image
    and no other install is in flight, so the install is a swap each rank
    finishes before it reads its next message, and the slot's rows may be in
    the very next plan (a rank that cannot swap installs from the host copy
    first, there and then)."""

    slot: int
    name: str
    digest: str
    host: AdapterHostRef
    rows_follow: bool = False


class CompileGrammar(Struct, frozen=True, tag=True, omit_defaults=True):
    """Compile a constrained request's grammar beside the steps, on every
    rank, before the request is scheduled: the rank answers GrammarCompiled
    and keeps it (its engine's cache) for the request's start."""

    request_id: str
    spec: StructuredSpec


class CancelCompile(Struct, frozen=True, tag=True, omit_defaults=True):
    """The request of a ``CompileGrammar`` ended before its grammar was in: a
    rank drops the compile if it is still waiting for its turn, and gives a
    running one's slot to the next (its thread runs out)."""

    request_id: str


ConductorToWorker = StepPlan | InstallAdapter | CompileGrammar | CancelCompile | Shutdown


# --------------------------------------------------------------------------
# worker -> conductor
# --------------------------------------------------------------------------


class WorkerReady(Struct, frozen=True, tag=True, omit_defaults=True):
    """What only a rank learns, its capacity (what fits its device's memory); the conductor takes the minimum.
    The model's facts (EOS ids, context) are the launcher's ``ModelInfo``, the block size the config's."""

    rank: int
    num_kv_blocks: int
    num_state_slots: int = 0  # sequences the recurrent-state pool holds; 0: no recurrent state
    num_state_snapshots: int = 0  # recurrent-state snapshots for prefix hits; 0: none (no prefix caching)


class StepDone(Struct, frozen=True, tag=True, omit_defaults=True):
    """Result of one StepPlan. Every rank samples identically; the conductor
    reads rank 0's tokens and uses the others' as acknowledgements."""

    step_id: int
    rank: int
    sampled: list[SampledToken]
    elapsed_s: float = 0.0


class StepFailed(Struct, frozen=True, tag=True, omit_defaults=True):
    """A step raised on a rank. ``request_ids`` names the rows to fail when the
    error is theirs (empty: the whole step failed)."""

    step_id: int
    rank: int
    message: str
    request_ids: list[str] = []


class AdapterInstalled(Struct, frozen=True, tag=True, omit_defaults=True):
    """One rank's answer to InstallAdapter (``error`` set when not ``ok``).
    ``kept``: the digests whose slot images the rank keeps after it, each a
    swap when installed again (``InstallAdapter.rows_follow``)."""

    rank: int
    slot: int
    digest: str
    ok: bool
    error: str = ""
    kept: list[str] = []


class GrammarCompiled(Struct, frozen=True, tag=True, omit_defaults=True):
    """One rank's answer to CompileGrammar (``error``: the engine's reason, when not ``ok``; ``busy``: the rank
    had no compile thread free, the request's input not at fault)."""

    rank: int
    request_id: str
    ok: bool
    error: str = ""
    busy: bool = False


WorkerToConductor = WorkerReady | StepDone | StepFailed | AdapterInstalled | GrammarCompiled


# --------------------------------------------------------------------------
# conductor <-> adapter-reader
# --------------------------------------------------------------------------


class ReadAdapter(Struct, frozen=True, tag=True, omit_defaults=True):
    """Read, validate and keep a host copy of an adapter folder."""

    name: str
    path: str
    # Read the files again even if a host copy of this name and path is
    # cached: a runtime (re)load is checked as its new file.
    refresh: bool = False
    # A runtime load's: its files are opened only inside lora.adapter_dirs (a configured adapter's are read
    # where their links lead).
    confined: bool = False


class DropAdapter(Struct, frozen=True, tag=True, omit_defaults=True):
    """The conductor no longer needs this host copy (evicted or unloaded)."""

    name: str
    digest: str


ConductorToAdapterReader = ReadAdapter | DropAdapter | Shutdown


class AdapterRead(Struct, frozen=True, tag=True, omit_defaults=True):
    name: str
    path: str
    digest: str
    host: AdapterHostRef
    max_rank: int


class AdapterReadFailed(Struct, frozen=True, tag=True, omit_defaults=True):
    """The adapter was refused; ``message`` names the module or file and why."""

    name: str
    path: str
    message: str
    # adapter_path_not_allowed: a file resolves outside lora.adapter_dirs (a 403); adapter_read_error: the
    # machine failed the read (shared memory full, an I/O error), not the files
    code: str = "invalid_adapter"


AdapterReaderToConductor = AdapterRead | AdapterReadFailed


# --------------------------------------------------------------------------
# launcher <-> actors (control)
# --------------------------------------------------------------------------


class Started(Struct, frozen=True, tag=True, omit_defaults=True):
    """Every actor is ready: the frontend may report healthy."""


class PeerFailed(Struct, frozen=True, tag=True, omit_defaults=True):
    """An actor process died; the frontend fails what is in flight."""

    actor: str
    reason: str


class Drain(Struct, frozen=True, tag=True, omit_defaults=True):
    """A signal came: the frontend stops admitting, lets what is in flight
    finish for up to ``timeout_s``, fails the rest, then answers ``Drained``."""

    timeout_s: float
    reason: str = ""


LauncherToActor = Started | PeerFailed | Drain | Shutdown


class ActorReady(Struct, frozen=True, tag=True, omit_defaults=True):
    actor: str
    pid: int
    address: str = ""  # where it serves clients (a frontend's URL, its bound port), if anywhere


class ActorError(Struct, frozen=True, tag=True, omit_defaults=True):
    """An unexpected exception in an actor, reported before it exits."""

    actor: str
    message: str
    traceback: str = ""
    user_error: bool = False  # the operator's to mend (a config key, the model folder, the port): one line, exit 2


class Drained(Struct, frozen=True, tag=True, omit_defaults=True):
    """The frontend's answer to ``Drain``: no request is in flight any more."""

    num_failed: int = 0  # requests still running at the timeout, failed with a 503


ActorToLauncher = ActorReady | ActorError | Drained
