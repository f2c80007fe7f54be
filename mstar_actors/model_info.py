"""Facts about the served model, computed once by the launcher.

``ModelInfo`` is built from the model folder and the validated config before
any actor starts (``load_model_info``), and travels to every actor in its
spec, so no actor parses ``config.json`` or derives the served name again.
What only the ranks can learn (the KV capacity) refines ``max_model_len``
through the conductor's agreement (``with_kv_capacity``), and the frontend
reads the refined copy.

The facts come from the same reader the ranks use (``models.spec``), so the
vocabulary, the EOS ids and the context length agree with what they load.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from mstar_actors.lora.base_shapes import BaseShapes

if TYPE_CHECKING:
    from mstar_actors.config import Config


class ModelInfo(msgspec.Struct, frozen=True):
    """One model's facts; every actor reads these, none re-derives them."""

    served_name: str  # what clients send as ``model``; adapters may not take it
    model_dir: str  # the resolved Hugging Face folder
    architecture: str  # config.json's ``architectures[0]``
    vocab_size: int  # the embedding's rows: the one vocabulary bound
    eos_token_ids: tuple[int, ...]  # config.json's, then generation_config.json's extras
    dtype: str  # the serving dtype after ``model.dtype: auto`` is resolved
    max_model_len: int  # prompt + output tokens; narrowed by the ranks' KV capacity
    is_multimodal: bool = False  # takes media parts (image / video, or audio)
    media_token_ids: dict[str, int] = {}  # "image" / "video" / "audio" -> its placeholder token (multimodal only)
    lora_base: BaseShapes | None = None  # what adapters must fit; None: this model takes none
    lora_refusal: str = ""  # why ``lora_base`` is None
    tp_refusal: str = ""  # why ``parallel.tp`` ranks cannot split this model ("" when they can)
    # A request's defaults of the sampling fields it leaves out, from generation_config.json (``models.spec``)
    sampling_defaults: dict[str, int | float] = {}

    def with_kv_capacity(self, num_kv_tokens: int) -> ModelInfo:
        """The same facts with ``max_model_len`` narrowed to what the KV cache holds."""
        return msgspec.structs.replace(self, max_model_len=min(self.max_model_len, num_kv_tokens))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_model_files(model_dir: str | Path) -> None:
    """``ModelLoadError`` naming what a served folder lacks (weights, whole
    ones, a tokenizer), found before any actor starts: an actor's load would fail
    on it inside a library, with a message that names neither."""
    from mstar_actors.models.loader import check_safetensors, safetensors_files
    from mstar_actors.models.spec import ModelLoadError

    folder = Path(model_dir)
    for path in safetensors_files(folder):
        check_safetensors(path)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        raise ModelLoadError(f"{folder}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)}, with "
                             "tokenizer_config.json); copy them from the model's repository into the folder")


def load_model_info(config: Config) -> ModelInfo:
    """Read the model folder ``config.model.path`` names (never the network).

    Raises ``FetchError`` for a folder that is not there, ``ModelLoadError``
    for a ``config.json`` the ranks could not serve, naming the field, and
    ``ConfigError`` for a ``scheduler.max_model_len`` past the model's context.
    """
    from mstar_actors.config import ConfigError
    from mstar_actors.fetch import resolve_model
    from mstar_actors.models.loader import load_spec
    from mstar_actors.models.sharding import tp_refusal
    from mstar_actors.models.spec import ModelLoadError, read_config, sampling_defaults

    model_dir = resolve_model(config.model.path)
    cfg = read_config(model_dir)  # the launcher's one read of config.json
    arch, spec = load_spec(model_dir, cfg)
    media = arch.media_token_ids(cfg, str(Path(model_dir) / "config.json")) if arch.is_multimodal else {}
    lora_base, lora_refusal = lora_base_of(cfg)
    dtype = _serving_dtype(config.model.dtype, config.model.device, spec.torch_dtype)
    if (problem := _quantization_problem(config, dtype)) is not None:
        raise ConfigError(problem)
    asked, positions = config.scheduler.max_model_len, spec.max_position_embeddings
    if asked is not None and asked > positions:  # as vLLM refuses it: past its positions the model is untrained
        raise ConfigError(f"scheduler.max_model_len {asked} is past the model's context ({positions} positions: "
                          f"max_position_embeddings in {Path(model_dir) / 'config.json'}); set at most {positions}, "
                          "or leave it out to serve the whole context")
    defaults = sampling_defaults(model_dir) if config.model.generation_config == "auto" else {}
    if (problem := _defaults_problem(defaults)) is not None:
        raise ModelLoadError(f"{Path(model_dir) / 'generation_config.json'}: {problem}; mend it, or set "
                             "model.generation_config: none to serve without its defaults")
    return ModelInfo(
        served_name=served_name(config.model.name, config.model.path, model_dir),
        model_dir=str(model_dir),
        architecture=arch.name,
        vocab_size=spec.vocab_size,
        eos_token_ids=tuple(spec.eos_token_ids),
        dtype=dtype,
        max_model_len=asked or positions,
        is_multimodal=bool(media),
        media_token_ids=media,
        lora_base=lora_base,
        lora_refusal=lora_refusal,
        tp_refusal=tp_refusal(spec, config.parallel.tp) or "",
        sampling_defaults=defaults,
    )


def _defaults_problem(defaults: dict) -> str | None:
    """Why a request could not send one of the model's sampling defaults (its range), or None."""
    from mstar_actors.frontend.openai_api import check_sampling_defaults

    try:
        check_sampling_defaults(defaults)
    except ValueError as err:
        return str(err).replace("max_tokens:", "max_new_tokens:")
    return None


def served_name(configured: str | None, path: str, folder: Path) -> str:
    """``model.name``, else the embedded name, else the folder's name."""
    from mstar_actors.fetch import EMBEDDED

    return configured or (path if path in EMBEDDED else Path(folder).name)


def lora_base_of(cfg: dict) -> tuple[BaseShapes | None, str]:
    """The shapes adapters must fit, or why this model takes no adapters (it
    still serves its base weights)."""
    from mstar_actors.lora.base_shapes import BaseShapesError

    try:
        return BaseShapes.from_hf_config(cfg), ""
    except BaseShapesError as err:
        return None, str(err)


def _quantization_problem(config: Config, dtype: str) -> str | None:
    """The ranks' refusal of ``model.quantization`` for the device and dtype, at start."""
    import torch

    from mstar_actors.models.cpu_quant import quantization_problem
    from mstar_actors.runner.device import resolve_device

    return quantization_problem(config.model.quantization, resolve_device(config.model.device).type,
                                getattr(torch, dtype))


def _serving_dtype(dtype: str, device: str, checkpoint_dtype: str | None) -> str:
    """The ranks' rule (``model_runner.resolve_dtype``), as a name that crosses processes."""
    from mstar_actors.config import ConfigError
    from mstar_actors.runner.device import resolve_device, resolve_dtype

    try:
        resolved = resolve_dtype(dtype, checkpoint_dtype, resolve_device(device))
    except RuntimeError as err:  # model.device: cuda on a host without one
        raise ConfigError(str(err)) from None
    return str(resolved).removeprefix("torch.")
