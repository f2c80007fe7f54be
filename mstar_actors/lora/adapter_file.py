"""Read and validate a PEFT LoRA adapter folder into CPU tensors.

The folder holds ``adapter_config.json`` and ``adapter_model.safetensors``
(PEFT's layout). Everything that could make a served adapter silently wrong
is refused here, once, with an ``AdapterError`` naming the adapter, the
tensor or module, and what would be accepted: DoRA, LoRA bias,
``modules_to_save``, a rank over the pool's ``max_rank``, a module the base
model has no rule for, a shape that does not fit it, a layer out of range, a
missing or corrupt file. What passes is ready for slot installation: per
module A [r, in], B [out, r] and the PEFT scale, plus a digest naming the
weights.

Pure apart from reading the two files; no device, no threads.

``allowed_dirs`` confines the read (runtime loads: ``lora.adapter_dirs``):
every file is opened first and then checked where the opened descriptor
really lies (``/proc/self/fd``), so a link inside the folder that points
out of it, or a file swapped for one between a check and the open, is
refused; the refusal names the file, never where it led.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import stat
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from mstar_actors.lora.base_shapes import EMBEDDING_MODULES, BaseShapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt")

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Module paths as PEFT saves them, after "base_model.model.": the decoder
# root is "model." (VL models: "model.language_model.").
# Qwen2-Audio's original layout nests the decoder as "language_model.model.".
_LAYER_RE = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.(.+)$")
_GLOBAL_RE = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?(embed_tokens|lm_head|unembed_tokens)$")
_GLOBAL_ALIASES = {"unembed_tokens": "lm_head"}  # the output head under another trainer's name
# A model's media encoder, either layout ("visual." or "model.visual."): the VL
# vision tower; Qwen2-Audio's audio encoder and its projector.
_ENCODER_RE = re.compile(r"^(?:model\.)?(visual|audio_tower|multi_modal_projector)\.")
_ENCODER_NAMES = {"visual": "vision tower", "audio_tower": "audio encoder", "multi_modal_projector": "audio encoder"}
_KINDS = {
    "lora_A.weight": "A",
    "lora_B.weight": "B",
    "lora_embedding_A": "A",
    "lora_embedding_B": "B",
}


class AdapterError(ValueError):
    """An adapter that can't be served; the message names adapter, tensor and reason."""


class AdapterFileOutside(AdapterError):
    """A file of the adapter resolves outside the allowed folders (a 403)."""


@dataclass(frozen=True)
class LoraModule:
    """One targeted module's factors: delta(x) = scale * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class AdapterWeights:
    """A validated adapter on the CPU, ready for slot installation.

    ``layers[i]`` maps a layer module suffix (``self_attn.q_proj``) to its
    factors; ``global_modules`` holds ``lm_head`` / ``embed_tokens``. Modules
    the adapter does not target are absent (their delta is zero).
    """

    name: str
    digest: str
    max_rank: int  # the largest rank of any module, <= the pool's max_rank
    layers: tuple[dict[str, LoraModule], ...]
    global_modules: dict[str, LoraModule]

    def iter_modules(self):
        """Yield (hf_module_name, LoraModule), e.g. ("model.layers.3.self_attn.k_proj", m)."""
        for index, modules in enumerate(self.layers):
            for suffix, module in modules.items():
                yield f"model.layers.{index}.{suffix}", module
        for name, module in self.global_modules.items():
            yield ("model.embed_tokens" if name == "embed_tokens" else name), module

    @property
    def num_modules(self) -> int:
        return sum(len(m) for m in self.layers) + len(self.global_modules)

    def to_dtype(self, dtype: torch.dtype) -> AdapterWeights:
        """The same adapter with its factors in ``dtype`` (the digest stays the
        file's). Raises AdapterError naming a module whose values overflow
        ``dtype`` (float16 tops out at 65504)."""

        def cast(hf_module: str, module: LoraModule) -> LoraModule:
            a, b = module.a.to(dtype), module.b.to(dtype)
            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                raise AdapterError(f"adapter {self.name!r}: module {hf_module!r} overflows {dtype} (the serving "
                                   "dtype); accepted: weights within its range, or serve in bfloat16 / float32")
            return LoraModule(a=a, b=b, scale=module.scale)

        layers = tuple({suffix: cast(f"model.layers.{i}.{suffix}", m) for suffix, m in modules.items()}
                       for i, modules in enumerate(self.layers))
        global_modules = {name: cast(name, m) for name, m in self.global_modules.items()}
        return dataclasses.replace(self, layers=layers, global_modules=global_modules)


# A module's weight as the served model's files hold it (``models.loader.stored_weight``): a context
# manager giving its lazy slice, or None
BaseWeights = Callable[[str], AbstractContextManager[Any]]


def read_adapter(path: str | Path, *, base: BaseShapes, max_rank: int, name: str | None = None,
                 allowed_dirs: Sequence[str] | None = None, base_weights: BaseWeights | None = None) -> AdapterWeights:
    """Read and validate the PEFT adapter folder at ``path`` against ``base``.

    With ``allowed_dirs`` (real paths), every file read must resolve inside
    one of them (AdapterFileOutside otherwise); None reads where links lead.
    With ``base_weights``, the copies of the embedding and head PEFT saves
    beside their factors are checked against the served ones (``_check_copy_values``).
    Raises AdapterError for anything that can't be served exactly.
    """
    folder = Path(path)
    name = name or folder.name
    config = _read_config(folder, name, allowed_dirs)
    _check_config(config, name)

    def check_copy(key: str, copy: Any) -> None:
        module = _check_base_copy(key, tuple(copy.get_shape()), base, name)
        if base_weights is None:
            return
        try:
            with base_weights(module) as served:
                if served is not None:
                    _check_copy_values(key, copy, served, module, name)
        except AdapterError:
            raise
        except (SafetensorError, OSError, RuntimeError, ValueError) as err:  # the served model's files, not its
            raise AdapterError(f"adapter {name!r}: the served model's {module} could not be read to check the "
                               f"adapter's copy of it ({err})") from None

    tensors = _read_tensors(_weights_path(folder, name), name, allowed_dirs, check_copy)
    pairs = _pair_tensors(tensors, base, name)
    layers = [dict() for _ in range(base.num_layers)]
    global_modules: dict[str, LoraModule] = {}
    placed: dict[tuple[str, int | None], str] = {}  # (module, layer) -> the path placed there
    for module_path, (a, b) in sorted(pairs.items()):
        slot_key, layer = _place(module_path, base, name)
        if (other := placed.setdefault((slot_key, layer), module_path)) != module_path:
            raise AdapterError(f"adapter {name!r}: {other!r} and {module_path!r} are the same module of this model "
                               f"(two spellings of its path), each with its own LoRA factors; accepted: one per "
                               "module (PEFT's save_pretrained writes one)")
        shape = base.shape_of(slot_key)
        _check_factors(a, b, shape, module_path, max_rank, name)
        module = LoraModule(a=a, b=b, scale=_scale(config, module_path, a.shape[0], name))
        if layer is None:
            global_modules[slot_key] = module
        else:
            layers[layer][slot_key] = module
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors (lora_A / lora_B)")
    return AdapterWeights(
        name=name,
        digest=_digest(pairs, layers, global_modules),
        max_rank=max(a.shape[0] for a, _ in pairs.values()),
        layers=tuple(layers),
        global_modules=global_modules,
    )


# ---------------------------------------------------------------- files


def is_inside(real: str, allowed_dirs: Sequence[str]) -> bool:
    """Whether the real path ``real`` is one of ``allowed_dirs`` or below one."""
    return any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in allowed_dirs)


@contextmanager
def open_inside(path: Path, allowed_dirs: Sequence[str] | None, name: str) -> Iterator[int]:
    """A descriptor of the regular file ``path``, checked after opening: the
    check is on the file opened, not on a name that could change under it.
    O_NONBLOCK so a FIFO planted in the folder cannot hang the open."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if allowed_dirs is not None and not is_inside(os.path.realpath(f"/proc/self/fd/{fd}"), allowed_dirs):
            raise AdapterFileOutside(f"adapter {name!r}: {path.name} resolves outside lora.adapter_dirs; a runtime "
                                     "load reads only files inside them (copy the adapter's files in, not links)")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AdapterError(f"adapter {name!r}: {path.name} is not a regular file")
        yield fd
    finally:
        os.close(fd)


def _read_config(folder: Path, name: str, allowed_dirs: Sequence[str] | None = None) -> dict:
    path = folder / CONFIG_FILE
    try:
        with open_inside(path, allowed_dirs, name) as fd, os.fdopen(os.dup(fd), "rb") as f:
            config = json.loads(f.read())
    except FileNotFoundError:
        if not folder.is_dir():
            raise AdapterError(f"adapter {name!r}: there is no folder {folder}; give the path of a PEFT adapter "
                               f"folder (its {CONFIG_FILE} and {WEIGHTS_FILE})") from None
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is missing from {folder}; a PEFT adapter folder needs it") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON ({err})") from None
    except NotADirectoryError:
        raise AdapterError(f"adapter {name!r}: {folder} is a file, not a folder; give the path of a PEFT adapter "
                           f"folder (its {CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except OSError as err:  # its strerror only: the exception's own text carries the path
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} could not be read ({err.strerror})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} must hold a JSON object, got {type(config).__name__}")
    return config


def _weights_path(folder: Path, name: str) -> Path:
    path = folder / WEIGHTS_FILE
    if path.is_file():
        return path
    for pickled in _PICKLE_FILES:
        if (folder / pickled).is_file():
            raise AdapterError(
                f"adapter {name!r}: {pickled} is a pickle, which is not loaded (it can run code); "
                f"save the adapter as {WEIGHTS_FILE} (PEFT: save_pretrained(..., safe_serialization=True))"
            )
    if path.exists() or path.is_symlink():  # a FIFO, a folder, a dangling link: no file to read
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} in {folder} is not a regular file; accepted: the "
                           "safetensors file PEFT's save_pretrained writes")
    raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is missing from {folder}")


def _read_tensors(path: Path, name: str, allowed_dirs: Sequence[str] | None,
                  check_copy: Callable[[str, Any], None]) -> dict[str, torch.Tensor]:
    """Every tensor but the base-layer copies PEFT saves next to embedding /
    lm_head adapters (``*.base_layer.weight``), which are the base model's
    weights (the served ones are kept): ``check_copy`` takes each's lazy slice."""
    try:
        with open_inside(path, allowed_dirs, name) as fd:
            # The checked descriptor's own file, whatever the name points at by now.
            return _read_checked_tensors(Path(f"/proc/self/fd/{fd}"), name, check_copy)
    except OSError as err:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} could not be opened ({err.strerror})") from None


def _read_checked_tensors(path: Path, name: str, check_copy: Callable[[str, Any], None]) -> dict[str, torch.Tensor]:
    """The factors read as one buffer of their own (``safetensors.torch.load``):
    safetensors 0.8's ``safe_open(...).get_tensor`` keeps ~64 bytes a tensor
    for good, 26 KB a read of a 420-tensor adapter, and every runtime load
    reads its file again. The base copies are checked through lazy slices,
    never read whole."""
    header, data_start = _checked_header(path, name)
    copies = [key for key in header if key.endswith(".base_layer.weight")]
    try:
        if copies:
            with safe_open(str(path), framework="pt") as f:
                for key in copies:
                    check_copy(key, f.get_slice(key))
        with path.open("rb") as f:
            return safetensors.torch.load(_buffer_of(f, data_start, {k: v for k, v in header.items()
                                                                     if k not in copies}))
    except (SafetensorError, OSError, RuntimeError) as err:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is corrupt or truncated ({err})") from None


def _buffer_of(f: Any, data_start: int, entries: dict) -> bytes:
    """A safetensors buffer of ``entries`` (header entries of the file ``f``, whose data begins at ``data_start``),
    their bytes read and laid end to end."""
    header, chunks, at = {}, [], 0
    for key, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
        start, end = entry["data_offsets"]
        f.seek(data_start + start)
        chunks.append(f.read(end - start))
        header[key] = entry | {"data_offsets": [at, at + end - start]}
        at += end - start
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as the format pads its header
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def _checked_header(path: Path, name: str) -> tuple[dict, int]:
    """(the tensors' header entries, where their data begins): the header's data offsets
    must fit the file, which catches a truncated copy before any tensor is read."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size:
                raise ValueError(f"header length {header_len} exceeds the file's {size} bytes")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        for key, entry in header.items():
            offsets = entry["data_offsets"]
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                raise ValueError(f"{key}: data_offsets {offsets!r} are not two ordered byte offsets")
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} has a corrupt header ({err})") from None
    if 8 + header_len + end > size:
        raise AdapterError(
            f"adapter {name!r}: {WEIGHTS_FILE} is truncated: {size} bytes, its header needs {8 + header_len + end}"
        )
    return header, 8 + header_len


# ---------------------------------------------------------------- config


# PEFT LoraConfig options that change what an adapter computes and are not served:
# refused by name (read as plain LoRA they would give other tokens without a word).
UNSERVED_OPTIONS = {
    "alora_invocation_tokens": "activated LoRA: on only after these tokens",
    "layer_replication": "a stack of replicated base layers",
    "use_qalora": "QALoRA's pooled inputs",
    "arrow_config": "Arrow routing over several adapters",
    "fan_in_fan_out": "weights stored transposed, as GPT-2's Conv1D",
    "trainable_token_indices": "trained rows of the token embedding beside the LoRA factors",
    "use_bdlora": "block-diagonal LoRA factors",
    "kasa_config": "KaSA's singular values between the factors",
    "monteclora_config": "MonteCLoRA's sampled mixture of factors",
    "target_parameters": "LoRA on bare parameters (such as MoE experts)",
}
# Initialisations that change the base weights as they make the factors (the adapter is then a delta on the
# changed base, not on the published one) unless saved with PEFT's conversion, which writes
# init_lora_weights=true.
RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def _check_config(config: dict, name: str) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {peft_type!r} is not served; accepted: LORA")
    if config.get("use_dora"):
        raise AdapterError(f"adapter {name!r}: DoRA (use_dora=true) is not served; accepted: plain LoRA (use_dora=false)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias={config['bias']!r} is not served; accepted: bias='none'")
    if config.get("lora_bias"):
        raise AdapterError(f"adapter {name!r}: lora_bias=true is not served; accepted: lora_bias=false")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"adapter {name!r}: modules_to_save={config['modules_to_save']} replaces base weights, which is not "
            "served; accepted: modules_to_save=null (adapt those modules with LoRA instead)"
        )
    for key, what in UNSERVED_OPTIONS.items():
        if config.get(key):
            raise AdapterError(f"adapter {name!r}: {key}={config[key]!r} ({what}) is not served; accepted: plain "
                               f"LoRA ({key} unset)")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(RESIDUAL_INITS):
        raise AdapterError(f"adapter {name!r}: init_lora_weights={init!r} trains against base weights PEFT changed "
                           "(a residual or quantised base), not this base model's; accepted: an adapter saved with "
                           "PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...), which makes "
                           "it a delta on the original weights")
    for key in ("r", "lora_alpha"):
        _check_number(config.get(key, 8), f"{CONFIG_FILE} field {key!r}", name, positive=key == "r")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} field {key!r} must be an object of module name "
                               f"patterns to numbers, like {{\"q_proj\": 8}}, got {type(pattern).__name__}")
        for module, value in pattern.items():
            try:
                re.compile(module)
            except re.error as err:
                raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} field {key!r}: {module!r} is not a regular "
                                   f"expression ({err}); accepted: module names or patterns of them") from None
            _check_number(value, f"{CONFIG_FILE} field {key!r}[{module!r}]", name, positive=key == "rank_pattern")


def _check_number(value, field: str, name: str, positive: bool) -> None:
    """A rank (``positive``) or an alpha: a finite number (true is not one). An alpha of 0 or below
    scales the delta by it, as PEFT computes it (a negative one subtracts what the adapter learned)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise AdapterError(f"adapter {name!r}: {field} must be a finite {'positive ' if positive else ''}number, "
                           f"got {value!r}")


def pattern_key(pattern_keys, module_path: str) -> str:
    """PEFT's ``get_pattern_key``: the first pattern that matches a dotted
    suffix of ``module_path`` (as a regex), else ``module_path`` itself."""
    for key in pattern_keys:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return key
    return module_path


def _scale(config: dict, module_path: str, rank: int, name: str) -> float:
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    r = rank_pattern.get(pattern_key(rank_pattern, module_path), config.get("r", 8))
    alpha = alpha_pattern.get(pattern_key(alpha_pattern, module_path), config.get("lora_alpha", 8))
    if r != rank:
        # The scale is alpha / r with the config's r: a mismatch means the
        # config does not describe these weights, so any scale would be a guess.
        raise AdapterError(
            f"adapter {name!r}: module {module_path!r} has rank {rank} in {WEIGHTS_FILE} but {CONFIG_FILE} says "
            f"r={r} (r / rank_pattern); accepted: a config that matches the weights"
        )
    return float(alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r)


# ---------------------------------------------------------------- tensors


def _split_key(key: str, name: str) -> tuple[str, str]:
    """'base_model.model.X.lora_A.weight' -> ('X', 'A'); refuses what is not plain LoRA."""
    path = key.removeprefix("base_model.model.")
    if "modules_to_save" in path:
        raise AdapterError(f"adapter {name!r}: tensor {key!r} is a modules_to_save copy, which is not served")
    if "lora_magnitude_vector" in path or path.endswith("dora_scale"):
        raise AdapterError(f"adapter {name!r}: tensor {key!r} is a DoRA magnitude; DoRA is not served, only plain LoRA")
    if re.search(r"\.lora_[AB]\.bias$", path) or path.endswith(".bias"):
        raise AdapterError(f"adapter {name!r}: tensor {key!r} is a LoRA bias, which is not served; accepted: lora_bias=false")
    for suffix, kind in _KINDS.items():
        if path.endswith("." + suffix):
            return path[: -len(suffix) - 1], kind
    if m := re.search(r"\.(lora_[AB])\.([^.]+)\.weight$|\.(lora_embedding_[AB])\.(?!weight$)([^.]+)$", path):
        raise AdapterError(
            f"adapter {name!r}: tensor {key!r} carries PEFT's adapter name {m.group(2) or m.group(4)!r} (a state_dict saved as "
            f"it is); accepted keys end in lora_A.weight / lora_B.weight / lora_embedding_A / lora_embedding_B, as "
            "PEFT's save_pretrained writes them"
        )
    if path.endswith(".weight") and ".lora_" not in path:
        raise AdapterError(
            f"adapter {name!r}: tensor {key!r} is a full module weight (PEFT saves modules_to_save that way), "
            "which would replace a base weight and is not served; accepted: LoRA factors only"
        )
    raise AdapterError(
        f"adapter {name!r}: tensor {key!r} is not a LoRA factor; accepted keys end in "
        "lora_A.weight / lora_B.weight / lora_embedding_A / lora_embedding_B"
    )


def _pair_tensors(tensors: dict, base: BaseShapes, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    found: dict[str, dict[str, torch.Tensor]] = {}
    keys: dict[tuple[str, str], str] = {}  # (module path, factor) -> its tensor's key
    for key, tensor in tensors.items():
        module_path, kind = _split_key(key, name)
        if tensor.dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} has dtype {tensor.dtype}; accepted: float32, float16, bfloat16")
        if not bool(torch.isfinite(tensor).all()):
            # Refused, not served: a NaN or infinity would also reach other adapters' rows
            # on the CPU's one-hot path, where a row keeps its own slot by multiplying by 0.
            raise AdapterError(f"adapter {name!r}: tensor {key!r} holds NaN or infinite values; accepted: finite "
                               "weights (the adapter's training diverged or its file is damaged)")
        if (other := keys.setdefault((module_path, kind), key)) != key:
            raise AdapterError(f"adapter {name!r}: tensors {other!r} and {key!r} are the same factor of module "
                               f"{module_path!r} (two spellings of one key); accepted: one tensor per factor "
                               "(PEFT's save_pretrained writes one)")
        found.setdefault(module_path, {})[kind] = tensor
    for module_path, kinds in found.items():
        missing = {"A", "B"} - kinds.keys()
        if missing:
            raise AdapterError(f"adapter {name!r}: module {module_path!r} has no lora_{missing.pop()} tensor; both factors are needed")
    return {path: (kinds["A"], kinds["B"]) for path, kinds in found.items()}


def _check_base_copy(key: str, shape: tuple[int, ...], base: BaseShapes, name: str) -> str:
    """The global module (``embed_tokens`` / ``lm_head``) of a saved base-layer copy, which must have the
    base model's shape: a resized vocabulary means the adapter was trained on another embedding table."""
    module_path = key.removeprefix("base_model.model.").removesuffix(".base_layer.weight")
    module, _ = _place(module_path, base, name)
    in_features, out_features = base.shape_of(module)
    expected = (in_features, out_features) if module in EMBEDDING_MODULES else (out_features, in_features)
    if shape != expected:
        raise AdapterError(
            f"adapter {name!r}: tensor {key!r} has shape {list(shape)} but the base model's {module} is "
            f"{list(expected)}; the adapter was trained with a resized vocabulary, which is not served"
        )
    return module


# A saved copy's row may differ from the served row by this share of its norm: a base's own rounding (a
# dtype, a GGUF's 8-bit table dequantized) stays far below it, a row the adapter trained or set does not.
MAX_COPY_CHANGE = 0.25
_COPY_ROWS = 4096  # rows compared at a time (a 128k x 4096 table: 64 MiB a block in float32)


def _check_copy_values(key: str, copy: Any, served: Any, module: str, name: str) -> None:
    """A saved base-layer copy must hold the served model's rows (to rounding): PEFT loads it over the
    base, so an adapter that trained its table (or was saved from other base weights) would answer with
    it, and only its LoRA factors are served."""
    rows = copy.get_shape()[0]
    if tuple(served.get_shape()) != tuple(copy.get_shape()):
        raise AdapterError(f"adapter {name!r}: tensor {key!r} has shape {copy.get_shape()} but the served model's "
                           f"{module} is {served.get_shape()}; accepted: an adapter trained on this base model")
    for start in range(0, rows, _COPY_ROWS):
        mine = copy[start : start + _COPY_ROWS].to(torch.float32)
        theirs = served[start : start + _COPY_ROWS].to(torch.float32)
        change = (mine - theirs).norm(dim=1) / theirs.norm(dim=1).clamp_min(1e-6)
        worst = int(change.argmax())
        if not change[worst] <= MAX_COPY_CHANGE:  # (NaN too)
            raise AdapterError(
                f"adapter {name!r}: its saved copy of the base model's {module} ({key!r}) differs from the served "
                f"model's: row {start + worst} by {float(change[worst]):.0%} of its norm (at most "
                f"{MAX_COPY_CHANGE:.0%} is rounding). The adapter trained or replaced that table, which is not "
                f"served (only LoRA factors are); accepted: an adapter trained on this base model with the table "
                f"frozen")


def _place(module_path: str, base: BaseShapes, name: str) -> tuple[str, int | None]:
    """(module key in BaseShapes, layer index or None for a global module)."""
    if m := _ENCODER_RE.match(module_path):
        # Its rows are not the step's token rows, so no slot could apply a delta there.
        encoder = _ENCODER_NAMES[m.group(1)]
        raise AdapterError(
            f"adapter {name!r}: module {module_path!r} is in the {encoder}; {encoder} modules are not "
            "adapter targets; accepted: the text stack's linears, lm_head, embed_tokens "
            "(PEFT: target_modules matching only the language model)"
        )
    if m := _GLOBAL_RE.match(module_path):
        key, layer = _GLOBAL_ALIASES.get(m.group(1), m.group(1)), None
    elif m := _LAYER_RE.match(module_path):
        key, layer = m.group(2), int(m.group(1))
        if layer >= base.num_layers:
            raise AdapterError(
                f"adapter {name!r}: module {module_path!r} is in layer {layer}, but the base model has "
                f"{base.num_layers} layers (0..{base.num_layers - 1})"
            )
    else:
        key, layer = module_path, None
    if base.shape_of(key) is None or (layer is None) != (key in base.global_modules):
        raise AdapterError(
            f"adapter {name!r}: module {module_path!r} is not a LoRA target of the base model; "
            f"accepted: {base.targetable()}"
        )
    if layer is not None and (why := base.allows(key, layer)) is not None:
        raise AdapterError(f"adapter {name!r}: module {module_path!r} is not in the base model: {why}")
    return key, layer


def _check_factors(a, b, shape, module_path: str, max_rank: int, name: str) -> None:
    in_features, out_features = shape
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(
            f"adapter {name!r}: module {module_path!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
            "accepted: A [r, in] and B [out, r] with the same r"
        )
    rank = a.shape[0]
    if rank < 1 or rank > max_rank:
        raise AdapterError(
            f"adapter {name!r}: module {module_path!r} has rank {rank}, over max_lora_rank={max_rank}; "
            "raise lora.max_lora_rank or use an adapter of lower rank"
        )
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterError(
            f"adapter {name!r}: module {module_path!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
            f"which do not fit the base model's {in_features} in / {out_features} out; accepted: "
            f"A [r, {in_features}], B [{out_features}, r] (an adapter trained for this base model)"
        )


def _digest(pairs, layers, global_modules) -> str:
    """blake2b over every module's name, scale, and both factors' dtype, shape and bytes, in sorted order."""
    scales = {f"layers.{i}.{k}": m.scale for i, mods in enumerate(layers) for k, m in mods.items()}
    scales.update({k: m.scale for k, m in global_modules.items()})
    h = hashlib.blake2b(digest_size=16)
    for module_path in sorted(pairs):
        h.update(module_path.encode())
        for tensor in pairs[module_path]:
            t = tensor.contiguous()
            h.update(f"|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy())
    for key in sorted(scales):
        h.update(f"{key}={scales[key]!r};".encode())
    return h.hexdigest()
