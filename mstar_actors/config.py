"""The serving config: YAML validated once into msgspec Structs.

A bad key or value is one ``ConfigError`` line naming the key path and what
would be accepted. The validated ``Config`` is passed down to every actor;
nothing deeper reads the environment.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]

_STRICT = dict(forbid_unknown_fields=True, kw_only=True)


class ConfigError(ValueError):
    """A config that can't be served. The message is one line for the user."""


class ModelConfig(msgspec.Struct, **_STRICT):
    path: str = "smollm2"  # a Hugging Face folder, or an embedded name
    name: str | None = None  # served name; default: the embedded name or the folder's name
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    # Weight-only quantization of the linear layers, CPU float32 only
    # (``mstar_actors.models.cpu_quant``): int8 or int4 in groups of 32
    # weights (GGUF's Q8_0 and Q4_1 schemes; the LM head is int8 under
    # both). "int4_a8": int4 with the activations rounded to int8 per group
    # of 32 and integer dot products (llama.cpp's Q4_1 x Q8_1 arithmetic:
    # faster, no longer equal to float32; AVX2 CPUs). "auto": an embedded
    # model's shipped quantization (smollm2: int4), else none; refused on
    # CUDA when set.
    quantization: Literal["auto", "none", "int8", "int4", "int4_a8"] = "auto"
    # CUDA only (on CPU these keys are accepted and ignored: every step runs
    # eagerly there). Pure decode steps of up to ``cuda_graph_max_batch``
    # sequences (default and cap: scheduler.max_num_seqs) replay CUDA graphs
    # captured at startup; so do steps with prefill chunks of up to that many
    # sequences and ``cuda_graph_max_tokens`` tokens in all (capped by
    # scheduler.max_num_batched_tokens; 0: such steps run eagerly). Larger
    # steps run eagerly, several times slower than graphed, so by default
    # every step the scheduler can plan is captured.
    # ``enforce_eager: true`` never captures (vLLM's name): slower steps,
    # faster startup, no graph memory.
    enforce_eager: bool = False
    cuda_graph_max_batch: Pos | None = None
    cuda_graph_max_tokens: NonNeg = 2048
    # How tool calls are read from the output: "auto" picks the format the
    # chat template asks for (see ``mstar_actors.frontend.tool_calls``).
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "qwen3_coder"] = "auto"
    # vLLM's --reasoning-parser: a chat reply's <think> ... </think> leaves in the message's
    # ``reasoning`` (streamed as delta.reasoning), the answer in content, and tool calls are read
    # from the answer only (``mstar_actors.frontend.reasoning``). "qwen3": Qwen3, Qwen3.5;
    # "deepseek_r1": replies that start inside the reasoning. None: the reply is all content.
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = None
    # vLLM's --generation-config: "auto" serves a request that leaves out temperature, top_p, top_k,
    # min_p, repetition_penalty or max_tokens with the model's generation_config.json values (its
    # max_new_tokens as max_tokens), as vLLM does by default; "none" with OpenAI's defaults.
    generation_config: Literal["auto", "none"] = "auto"


class ParallelConfig(msgspec.Struct, **_STRICT):
    tp: Pos = 1
    # Each worker's torch intra-op threads. Default: on CPU the cores this
    # server may use, split between the ranks (the step's GEMMs are the
    # server's work; the other actors are single-threaded loops); on a GPU 1
    # (the device works, spare threads only spin). Settled at parse
    # (``with_device_defaults``): the workers and prepare's CPU plan read it.
    worker_torch_threads: Pos | None = None


# Sequences a step may hold when scheduler.max_num_seqs is not set: on CUDA
# vLLM's 256 (a decode step's cost grows slowly with its rows there); on CPU
# a step's cost grows with every row, so fewer keep each stream's pace.
DEFAULT_MAX_NUM_SEQS = {"cuda": 256, "cpu": 64}
MAX_NUM_SEQS = 1 << 16  # a step's rows at most (vLLM's default is 256 on a GPU): past it, tables no host holds
# scheduler.async_scheduling and steps_ahead when not set. A GPU step leaves the
# host's cores free to plan the next. A CPU step wants every core, but once idle
# OpenMP threads sleep soon (``launcher.OPENMP_SPIN_COUNT``) the conductor's turn
# beside it costs less than waiting for it (docs/benchmarks.md, against llama.cpp);
# two plans ahead were level with one there, so one (fewer dropped rows at a stop).
DEFAULT_ASYNC_SCHEDULING = {"cuda": True, "cpu": True}
DEFAULT_STEPS_AHEAD = {"cuda": 2, "cpu": 1}


class SchedulerConfig(msgspec.Struct, **_STRICT):
    # None: DEFAULT_MAX_NUM_SEQS of the device (resolved by ``parse_config``).
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, le=MAX_NUM_SEQS)] | None = None
    max_num_batched_tokens: Pos = 2048
    max_model_len: Pos | None = None  # default: the model's own context length
    # Plan each step while the ranks run the one before (vLLM's name): the
    # ranks never wait for a result's round trip and the next plan. A row is
    # then planned past a token that may end its request (EOS, a stop token):
    # that row's token is computed and dropped. false: one step at a time.
    # None: DEFAULT_ASYNC_SCHEDULING of the device.
    async_scheduling: bool | None = None
    # With async_scheduling, the plans sent past the step whose result the
    # conductor awaits: 1, a rank finds the next plan waiting when a step
    # ends; 2, also the one after, so the conductor's turn (the result's
    # trip, the update, the plan) is hidden behind a step too; an EOS or
    # stop token costs two dropped rows, and a new request's prefill runs
    # a step later. None: with async_scheduling DEFAULT_STEPS_AHEAD of the
    # device (on an H200, tools/bench_lora.py, 2 against 1: LoRA off +5% tok/s
    # at c=1, +10% at 32, +20% at 64 and 256, TTFT p50 +2-4 ms at 64-256), else 1.
    steps_ahead: Literal[1, 2] | None = None
    # A step not answered by every rank in this long stops the server: a rank
    # hung (stopped, or stuck in a kernel), and its requests fail with the
    # reason instead of waiting for ever (as vLLM's execute-model timeout, 300 s).
    step_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0
    # A constrained request whose grammar some rank has not compiled in this long (from the compile's start)
    # fails with a 400 naming its field (as SGLang's grammar timeout): a pathological pattern holds neither the
    # batch nor other requests' compiles, and its compile runs out on a thread of its own.
    grammar_compile_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 60.0


class KvConfig(msgspec.Struct, **_STRICT):
    block_size: Pos = 16
    memory_fraction: Fraction = 0.9  # of free device memory (CPU: of available RAM, capped below)
    num_blocks: Pos | None = None  # overrides memory_fraction
    enable_prefix_caching: bool = True
    # A hybrid model's (Qwen3.5) prefix cache: copies of the recurrent state where
    # prompts' last full blocks end, each as large as one sequence's state.
    # Default: scheduler.max_num_seqs; 0: no snapshots, no prefix caching for it.
    state_snapshots: NonNeg | None = None


class LoraConfig(msgspec.Struct, **_STRICT):
    max_loras: Pos = 4
    max_lora_rank: Pos = 16
    # Host copies the adapter-reader keeps (least recently used evicted); on a
    # GPU each rank also keeps as many pinned images of installed slots (those
    # that fit 1% of its memory on the device too), so an adapter swapped back
    # in is one copy, not a new read and staging.
    max_cpu_loras: Pos = 8
    adapters: dict[str, str] = {}
    # On CUDA, from the this-many-th step in a row whose rows are all on one adapter, steps on it
    # run on it merged into the decoder's weights (the base model's steps, at its speed); the
    # first step with other rows restores them from a copy kept as loaded, which costs the
    # decoder linears' weight bytes once more. Merges that did not last make the next wait
    # longer. Adapters on the embedding or LM head are never merged. 0: never (no copy). Not on CPU.
    merge_after_steps: NonNeg = 16
    allow_runtime_updates: bool = False
    adapter_dirs: list[str] = []


class PrepareConfig(msgspec.Struct, **_STRICT):
    preprocess_workers: Pos | None = None  # default: sized by CpuPlan
    preprocess_torch_threads: Pos = 1
    # Pin each pool thread (audio: each clip process) to CPUs of its own
    # (CpuPlan.pool_cpus) when the CPUs left for preparation allow it; false
    # lets the OS place them.
    pin_pool_threads: bool = True


class ServerConfig(msgspec.Struct, **_STRICT):
    host: str = "127.0.0.1"
    port: Port = 8000
    api_key: str | None = None
    # CORS, as vLLM's --allowed-origins: browsers' pages from these origins may call
    # the server ("*": any, the default; []: none). Preflights need no API key.
    allowed_origins: list[str] = msgspec.field(default_factory=lambda: ["*"])
    max_body_bytes: Pos = 4 * 1024 * 1024
    # Choices (prompts x n) waiting past the running sequences before a new
    # request is a 503: the engine's count, and between its reports (a step
    # apart) each frontend's own estimate, so with api_server_count N a burst
    # may pass it by up to N times until the next report.
    max_waiting_requests: Pos = 1024
    allowed_media_dir: str | None = None
    # http(s) media may reach only public addresses (mstar_actors.prepare.media_guard).
    # allowed_media_domains (vLLM's name): when it lists host names, only
    # those may be fetched. allow_private_media_addresses: loopback, private
    # and this host's addresses too (a media server on the operator's network).
    allowed_media_domains: list[str] = []
    allow_private_media_addresses: bool = False
    # Media input (image_url / video_url, audio_url / input_audio content parts);
    # every limit is per item unless named per request. A refusal is a 400
    # naming the part and the limit.
    max_media_bytes: Pos = 20 * 1024 * 1024  # encoded bytes of one image, video or audio clip
    max_image_pixels: Pos = 4096 * 4096  # width x height, checked from the header before decoding
    max_video_frames: Pos = 64  # frames kept after sampling at video_fps
    max_video_seconds: Annotated[float, msgspec.Meta(gt=0.0)] = 120.0
    # pixels of all the frames a video keeps, decoded (3 bytes each): 1080p at max_video_frames, 4K at 16
    max_video_pixels: Pos = 64 * 1920 * 1080
    max_media_items: NonNeg = 8  # per request; 0 refuses media
    video_fps: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0  # frames sampled per second of video
    # Seconds of one audio clip; the model's feature extractor may hear fewer (Qwen2-Audio: 30).
    max_audio_seconds: Annotated[float, msgspec.Meta(gt=0.0)] = 30.0
    media_fetch_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0  # whole http(s) fetch
    max_media_redirects: NonNeg = 3
    # Idle and slow clients. A connection with no request in progress (a new
    # one, one between requests, or one that sent half a header) is closed
    # after ``keepalive_timeout_s``; a request whose header and body are not
    # fully received within ``request_read_timeout_s`` of its first byte is a
    # 408 and the connection closes. Beyond ``max_connections`` open connections (capped at start
    # below the descriptor limit) a new one gets a 503 and is closed.
    keepalive_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0
    request_read_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 30.0
    max_connections: Pos = 1000
    # On SIGTERM / SIGINT / SIGHUP the frontend stops admitting (503) and lets requests
    # in flight finish for at most this long; what is left then fails with a 503.
    shutdown_timeout_s: Annotated[float, msgspec.Meta(ge=0.0)] = 30.0
    # Frontend processes on the one port (vLLM's --api-server-count; the kernel
    # spreads connections over them): each parses, detokenizes and streams its
    # own, which one Python process cannot keep up with for a GPU's hundreds of
    # streams. More than one needs a fixed port (not 0); max_connections is each one's.
    api_server_count: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # POST /v1/responses keeps each Response whose request left ``store`` true (OpenAI's default) in this
    # many MiB of the frontend's memory, the least recently used dropped: ``previous_response_id`` and
    # GET/DELETE /v1/responses/{id} read it. 0 (the default, as vLLM's): nothing is kept. One frontend
    # only: a follow-up may reach any of several.
    responses_store_mib: NonNeg = 0


ORPHEUS_VOICES = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]


class SpeechConfig(msgspec.Struct, **_STRICT):
    # Text to speech (``POST /v1/audio/speech``) for an Orpheus model: the
    # served Llama writes SNAC codec tokens, the frontend decodes them with the
    # SNAC folder named here (config.json + pytorch_model.bin; never fetched).
    # None: no speech route.
    snac_path: str | None = None
    voices: list[str] = msgspec.field(default_factory=lambda: list(ORPHEUS_VOICES))
    codec_device: Literal["auto", "cpu", "cuda"] = "auto"  # where the codec decodes; auto: cuda if there is one
    codec_threads: Pos = 2  # torch threads of the codec on CPU
    # Sampling defaults of a speech request (Orpheus's own); a body may override them.
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.6
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.8
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] = 1.3
    # codec tokens of a reply: 7 per frame of 2048 samples (85 ms at 24 kHz); None: up to the context (the whole
    # input spoken, as OpenAI's speech speaks it), a number cuts every reply there (1200: about 14 s)
    max_tokens: Pos | None = None


class TransportConfig(msgspec.Struct, **_STRICT):
    # Each ring's size; raised where one sequence of max_model_len tokens needs more (``ring_sizes``).
    ring_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 4 * 1024 * 1024
    arena_bytes: Annotated[int, msgspec.Meta(ge=1 << 16)] = 64 * 1024 * 1024


class DebugConfig(msgspec.Struct, **_STRICT):
    # Actors to run under cProfile ("conductor", "worker0", "frontend", ...): each writes NAME.prof into
    # profile_dir when the server stops (``python -m pstats NAME.prof``). cProfile about doubles the time of
    # Python calls: it shows where an actor's time goes, not how fast it serves.
    profile_actors: list[str] = []
    profile_dir: str = "."


class Config(msgspec.Struct, **_STRICT):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    kv: KvConfig = msgspec.field(default_factory=KvConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    prepare: PrepareConfig = msgspec.field(default_factory=PrepareConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    speech: SpeechConfig = msgspec.field(default_factory=SpeechConfig)
    debug: DebugConfig = msgspec.field(default_factory=DebugConfig)


def _type_at(path: str) -> object:
    """The declared type at a `$.a.b` config path (None where unknown)."""
    typ: object = Config
    for part in [p for p in path.removeprefix("$").split(".") if p]:
        if not (isinstance(typ, type) and issubclass(typ, msgspec.Struct)):
            return None
        info = {f.name: f for f in msgspec.structs.fields(typ)}
        typ = info[part].type if part in info else None
    return typ


def _fields_at(path: str) -> list[str]:
    """The accepted keys of the struct at a `$.a.b` path, for error messages."""
    typ = _type_at(path)
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        return [f.name for f in msgspec.structs.fields(typ)]
    return []


def _explain(err: msgspec.ValidationError) -> str:
    text = str(err)
    if "unknown field" in text and " - at `" in text:
        where = text.rsplit(" - at `", 1)[1].rstrip("`")
        accepted = _fields_at(where)
        if accepted:
            text += f"; accepted keys there: {', '.join(accepted)}"
    elif "unknown field" in text:
        text += f"; accepted top-level keys: {', '.join(_fields_at('$'))}"
    elif "Invalid enum value" in text and " - at `" in text:
        choices = _choices(_type_at(text.rsplit(" - at `", 1)[1].rstrip("`")))
        if choices:
            text += f"; accepted: {', '.join(choices)}"
    return text


def _choices(tp: object) -> list[str]:
    """A Literal's values, an optional one's with null (not set: the default)."""
    if typing.get_origin(tp) is typing.Literal:
        return [str(v) for v in typing.get_args(tp)]
    return [c for arg in typing.get_args(tp) for c in (["null"] if arg is type(None) else _choices(arg))]


def parse_config(data: object, source: str = "<config>") -> Config:
    """Validate a decoded YAML/JSON object into a Config (raises ConfigError)."""
    if data is None:
        data = {}
    if isinstance(data, dict):  # a section of comments alone (YAML's null) takes its defaults, as an empty file does
        data = {section: values for section, values in data.items() if values is not None}
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as err:
        raise ConfigError(f"{source}: {_explain(err)}") from None
    if config.server.api_server_count > 1 and config.server.port == 0:
        raise ConfigError(f"{source}: server.port 0 (any free port) with server.api_server_count "
                          f"{config.server.api_server_count}: each frontend would bind a port of its own; "
                          "set a fixed port, or api_server_count: 1")
    if config.server.api_server_count > 1 and config.server.responses_store_mib:
        raise ConfigError(f"{source}: server.responses_store_mib with server.api_server_count "
                          f"{config.server.api_server_count}: a Response is kept in the frontend that answered it, "
                          "and a request continuing it may reach another; set api_server_count: 1 to keep "
                          "responses, or responses_store_mib: 0")
    config = with_device_defaults(with_expanded_paths(config))
    if config.scheduler.steps_ahead > 1 and not config.scheduler.async_scheduling:  # set so, not defaulted
        raise ConfigError(f"{source}: scheduler.steps_ahead {config.scheduler.steps_ahead} needs "
                          "scheduler.async_scheduling, which is set false here; "
                          "set async_scheduling: true, or steps_ahead: 1")
    return config


def with_expanded_paths(config: Config) -> Config:
    """``config`` with ``~`` expanded in the adapters' paths and folders (``lora.adapters``,
    ``lora.adapter_dirs``), ``server.allowed_media_dir`` and ``debug.profile_dir``, so configs may point at the
    user's folders and every actor reads one path."""
    lora, server, debug = config.lora, config.server, config.debug
    adapters = {name: os.path.expanduser(path) for name, path in lora.adapters.items()}
    dirs = [os.path.expanduser(d) for d in lora.adapter_dirs]
    media = None if server.allowed_media_dir is None else os.path.expanduser(server.allowed_media_dir)
    return msgspec.structs.replace(
        config, lora=msgspec.structs.replace(lora, adapters=adapters, adapter_dirs=dirs),
        server=msgspec.structs.replace(server, allowed_media_dir=media),
        debug=msgspec.structs.replace(debug, profile_dir=os.path.expanduser(debug.profile_dir)))


def with_device_defaults(config: Config) -> Config:
    """``config`` with the keys whose default depends on the device filled in
    (``scheduler.max_num_seqs``, ``async_scheduling``, ``steps_ahead``,
    ``parallel.worker_torch_threads``), so every actor reads one settled value."""
    sched = config.scheduler
    if (sched.max_num_seqs is not None and sched.async_scheduling is not None and sched.steps_ahead is not None
            and config.parallel.worker_torch_threads is not None):
        return config
    device = config.model.device
    if device == "auto":
        from mstar_actors.runner.device import resolve_device  # torch only where the device must be probed

        device = resolve_device(device).type
    async_scheduling = DEFAULT_ASYNC_SCHEDULING[device] if sched.async_scheduling is None else sched.async_scheduling
    scheduler = msgspec.structs.replace(
        sched,
        max_num_seqs=DEFAULT_MAX_NUM_SEQS[device] if sched.max_num_seqs is None else sched.max_num_seqs,
        async_scheduling=async_scheduling,
        steps_ahead=(DEFAULT_STEPS_AHEAD[device] if async_scheduling else 1) if sched.steps_ahead is None
        else sched.steps_ahead,
    )
    threads = config.parallel.worker_torch_threads or default_worker_threads(device, len(os.sched_getaffinity(0)),
                                                                             config.parallel.tp)
    return msgspec.structs.replace(config, scheduler=scheduler,
                                   parallel=msgspec.structs.replace(config.parallel, worker_torch_threads=threads))


def default_worker_threads(device_type: str, num_cpus: int, tp: int) -> int:
    """A rank's torch intra-op threads when the config sets none (``ParallelConfig``)."""
    return max(1, num_cpus // tp) if device_type == "cpu" else 1


def server_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (an empty host: every address, as 0.0.0.0)."""
    host = host or "0.0.0.0"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _yaml_problem(err: yaml.YAMLError) -> str:
    """The parser's complaint by the file's own lines: "line 4, column 7: expected ',' or ']', but got ':'
    (while parsing a flow sequence from line 3, column 9)"."""
    def at(mark: typing.Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if not problem or mark is None:
        return " ".join(str(err).split())
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    where = f" ({context} from {at(context_mark)})" if context and context_mark is not None else ""
    return f"{at(mark)}: {problem}{where}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key written twice in one mapping: the later would replace the earlier
    unseen (a whole section, with whatever value of it was wrong)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor": its keys may be written again here
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):  # (the base loader refuses it, in its words)
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key].line + 1}); write it once",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike, **overrides: dict) -> Config:
    """Read and validate a YAML config. ``overrides`` maps section -> {key: value}
    (the CLI's --host/--port), applied before validation."""
    p = Path(path)
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file; see configs/ for examples") from None
    except (OSError, UnicodeDecodeError) as err:  # a folder, unreadable, not UTF-8 text
        raise ConfigError(f"{p}: cannot read it as a YAML file ({type(err).__name__}: {err}); give the path of a "
                          "UTF-8 YAML config, like those in configs/") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of sections (model, server, ...), got {type(data).__name__}")
    for section, values in overrides.items():
        if values and (data.get(section) is None or isinstance(data[section], dict)):  # else refused below
            data[section] = {**(data.get(section) or {}), **values}
    try:
        return parse_config(data, str(p))
    except ConfigError as err:  # a flag's value is the flag's fault, not the file's
        for section, values in overrides.items():
            for key, value in (values or {}).items():
                if f"`$.{section}.{key}`" in str(err):
                    raise ConfigError(str(err).replace(f"{p}: ", f"--{key} {value}: ", 1)) from None
        raise
