"""Load a Hugging Face folder into the native decoder.

Every problem is found before serving starts and reported as one
``ModelLoadError`` naming the file, field or tensor and what was expected:
an unknown architecture, a config the code can't serve, a missing,
unexpected or mis-shaped tensor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from .attention import PagedAttention, TorchPagedAttention
from .decoder import CausalLM, StackedLinear
from .registry import ARCHITECTURES, Architecture
from .spec import ModelLoadError, ModelSpec, parse_spec, read_config

log = logging.getLogger(__name__)

_MAX_LISTED = 5  # names listed in one error before "... and N more"


def architecture_of(model_dir: Path, cfg: dict) -> Architecture:
    names = cfg.get("architectures") or []
    if not names:
        raise ModelLoadError(f"{Path(model_dir) / 'config.json'}: field 'architectures' is missing")
    arch = ARCHITECTURES.get(names[0])
    if arch is None:
        raise ModelLoadError(
            f"{Path(model_dir) / 'config.json'}: architecture {names[0]!r} is not supported; "
            f"accepted: {', '.join(sorted(ARCHITECTURES))}"
        )
    return arch


def load_spec(model_dir: Path, cfg: dict | None = None) -> tuple[Architecture, ModelSpec]:
    """The architecture and decoder shape of ``model_dir``, from its parsed
    ``config.json`` (read here when not given)."""
    cfg = read_config(model_dir) if cfg is None else cfg
    arch = architecture_of(model_dir, cfg)
    text_cfg = arch.text_config(cfg) if arch.text_config else cfg
    return arch, parse_spec(model_dir, text_cfg, qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """Build the decoder for ``model_dir`` on ``device`` in ``dtype`` and fill its weights."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)  # the rank's one read of config.json
    arch, spec = load_spec(model_dir, cfg)
    with torch.device("meta"):
        backend = attention_backend(device)
        model = arch.build(model_dir, cfg, spec, backend) if arch.build else CausalLM(spec, backend)
    model = model.to_empty(device=device).to(dtype)
    targets = _weight_targets(model, arch)
    _fill_weights(model_dir, targets, arch, spec)
    return model.eval()


def attention_backend(device: torch.device | str) -> PagedAttention:
    """The attention backend for ``device``, picked once as the model is built:
    on CUDA the Triton kernels (``TritonPagedAttention``) when Triton imports,
    else the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            from .triton_attention import TritonPagedAttention
        except ImportError as err:  # Triton missing or broken: correct, just slower
            log.warning("attention: Triton unavailable (%s); using the torch reference on %s", err, device)
        else:
            return TritonPagedAttention()
    return TorchPagedAttention()


def _weight_targets(model: CausalLM, arch: Architecture) -> dict[str, torch.Tensor]:
    """HF tensor name -> the view of our parameter it fills (a shard slice for fused modules)."""
    targets: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        shards = range(len(module.output_sizes)) if isinstance(module, StackedLinear) else [None]
        for shard in shards:
            hf = arch.rules.hf_module(module_name, shard)
            targets[f"{hf}.{leaf}"] = param.data if shard is None else param.data[module.shard_slice(shard)]
    return targets


def safetensors_files(model_dir: Path) -> list[Path]:
    """Shards named by ``model.safetensors.index.json``, else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index}: names shard {f.name} but {f} does not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found (other weight formats are not supported)")
    return files


def _fill_weights(model_dir: Path, targets: dict[str, torch.Tensor], arch: Architecture, spec: ModelSpec) -> None:
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for stored_name in f.keys():
                name = arch.rules.canonical(stored_name)
                if arch.rules.is_ignored(name) or (spec.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                tensor = f.get_slice(stored_name)
                shape = tuple(tensor.get_shape())
                if shape != tuple(target.shape):
                    raise ModelLoadError(
                        f"{path.name}: tensor {name!r} has shape {list(shape)}, expected "
                        f"{list(target.shape)} for {spec.architecture} with this config.json"
                    )
                target.copy_(f.get_tensor(stored_name))
                loaded.add(name)
    _check_complete(model_dir, targets, loaded, unexpected, spec)


def _check_complete(model_dir, targets, loaded, unexpected, spec) -> None:
    missing = sorted(set(targets) - loaded)
    if missing:
        hint = " (or set tie_word_embeddings=true)" if missing == ["lm_head.weight"] else ""
        raise ModelLoadError(f"{model_dir}: missing tensor(s) {_listed(missing)} for {spec.architecture}{hint}")
    if unexpected:
        raise ModelLoadError(
            f"{model_dir}: unexpected tensor(s) {_listed(sorted(unexpected))}; "
            f"{spec.architecture} with this config.json has no such weight"
        )


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" ... and {more} more" if more > 0 else "")
