"""Load a Hugging Face folder into the native decoder.

Every problem is found before serving starts and reported as one
``ModelLoadError`` naming the file, field or tensor and what was expected:
an unknown architecture, a config the code can't serve, a missing,
unexpected or mis-shaped tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from .attention import PagedAttention, TorchPagedAttention
from .decoder import CausalLM, StackedLinear
from .deltanet_ops import DeltaNetOps, TorchDeltaNetOps
from .lora_layers import EMBED_TOKENS
from .registry import ARCHITECTURES, REFUSED, Architecture
from .sharding import Cut, ShardLayout, single_rank_layout
from .spec import ModelLoadError, ModelSpec, parse_spec, read_config

if TYPE_CHECKING:
    from mstar_actors.runner.parallel import TensorParallel

log = logging.getLogger(__name__)

_MAX_LISTED = 5  # names listed in one error before "... and N more"


def architecture_of(model_dir: Path, cfg: dict) -> Architecture:
    names = cfg.get("architectures") or []
    if not names:
        raise ModelLoadError(f"{Path(model_dir) / 'config.json'}: field 'architectures' is missing")
    arch = ARCHITECTURES.get(names[0])
    if names[0] in REFUSED:
        raise ModelLoadError(f"{Path(model_dir) / 'config.json'}: architecture {names[0]!r}: {REFUSED[names[0]]}")
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


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
               tp: TensorParallel | None = None) -> CausalLM:
    """Build the decoder for ``model_dir`` on ``device`` in ``dtype`` and fill
    its weights: under tensor parallelism (``tp``) this rank's shard only,
    read as slices of the checkpoint's tensors."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)  # the rank's one read of config.json
    arch, spec = load_spec(model_dir, cfg)
    layout = single_rank_layout(spec) if tp is None else ShardLayout(spec, tp)
    with torch.device("meta"):
        backend = attention_backend(device)
        model = arch.build(model_dir, cfg, spec, backend, layout) if arch.build else CausalLM(spec, backend, layout)
    model = model.to_empty(device=device).to(dtype)
    if spec.is_hybrid:
        model.use_ops(deltanet_ops(device))
    targets = _weight_targets(model, arch)
    num_full = _fill_weights(model_dir, targets, arch, spec)
    num_held = sum(p.numel() for p in model.parameters())
    log.info("rank %d of %d holds %.4gM of %.4gM parameters", layout.rank, layout.world_size, num_held / 1e6,
             num_full / 1e6)
    return model.eval()


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: ``view`` of our parameter, filled
    from ``cut`` of the tensor (None: all of it); ``zero`` for a
    row-parallel bias on a rank other than 0 (the bias is added once)."""

    view: torch.Tensor
    cut: Cut | None = None
    zero: bool = False

    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.view.shape)
        if self.cut is not None:
            shape[self.cut.dim] = self.cut.full
        return tuple(shape)


def attention_backend(device: torch.device | str) -> PagedAttention:
    """The attention backend for ``device``, picked once as the model is built:
    on CUDA the Triton kernels (``TritonPagedAttention``) when Triton imports,
    else the torch reference; on CPU the reference with decode rows on our
    kernel (``cpu_attention``, itself the reference where it can't build)."""
    if torch.device(device).type == "cuda":
        try:
            from .triton_attention import TritonPagedAttention
        except ImportError as err:  # Triton missing or broken: correct, just slower
            log.warning("attention: Triton unavailable (%s); using the torch reference on %s", err, device)
        else:
            return TritonPagedAttention()
        return TorchPagedAttention()
    from .cpu_attention import CpuPagedAttention

    return CpuPagedAttention()


def deltanet_ops(device: torch.device | str) -> DeltaNetOps:
    """Gated DeltaNet's ops for ``device``: on CUDA the Triton kernels where
    they import and pass their check, else the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            from .deltanet_triton import TritonDeltaNetOps
        except ImportError as err:  # the kernels missing or broken: correct, just slower
            log.warning("deltanet: Triton kernels unavailable (%s); using the torch reference on %s", err, device)
        else:
            return TritonDeltaNetOps()
    return TorchDeltaNetOps()


def _weight_targets(model: CausalLM, arch: Architecture) -> dict[str, Target]:
    """HF tensor name -> where it goes (a shard slice for fused modules, the
    rank's cut of it under tensor parallelism)."""
    targets: dict[str, Target] = {}
    rank = model.layout.rank
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        cuts = getattr(module, "tp_slices", {})
        parts = arch.rules.checkpoint_parts(module_name)
        if not parts:
            raise KeyError(f"no checkpoint rule fills {module_name!r}")
        for hf, shard, span in parts:
            if shard is None or not isinstance(module, StackedLinear):
                view = param.data
            else:  # the rows of shards shard .. shard + span - 1
                view = param.data[module.shard_slice(shard).start : module.shard_slice(shard + span - 1).stop]
            targets[f"{hf}.{leaf}"] = _target(view, cuts.get(shard) if span == 1 else None, rank)
    return targets


def _target(view: torch.Tensor, cut: Cut | None, rank: int) -> Target:
    if cut is None or cut.is_whole:
        return Target(view)
    if view.ndim == 1 and cut.dim == 1:  # a row-parallel linear's bias: whole, on one rank
        return Target(view, zero=rank != 0)
    return Target(view, cut)


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


MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit


def check_safetensors(path: Path) -> None:
    """``ModelLoadError`` naming a weights file that is cut short or not
    safetensors at all, read from its header alone (the format: a little-endian
    u64 header size, the JSON header, then the tensors' bytes, which end where
    the file does)."""
    size = path.stat().st_size
    redo = "download it again (or run `python -m mstar_actors fetch` for the embedded model)"
    with open(path, "rb") as f:
        head = f.read(8)
        num = int.from_bytes(head, "little") if len(head) == 8 else -1
        if num < 2 or 8 + num > size or num > MAX_SAFETENSORS_HEADER:
            raise ModelLoadError(f"{path}: not a safetensors file, or cut short ({size} bytes); {redo}")
        try:
            header = json.loads(f.read(num))
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
            if not all(isinstance(e, int) and not isinstance(e, bool) for e in ends):
                raise TypeError("data_offsets")
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ModelLoadError(f"{path}: its safetensors header is not valid; {redo}") from None
        end = max(ends, default=0)
    if 8 + num + end != size:
        raise ModelLoadError(f"{path}: holds {size} bytes, its header says {8 + num + end}: the file is "
                             f"{'cut short' if 8 + num + end > size else 'longer than its tensors'}; {redo}")


def _fill_weights(model_dir: Path, targets: dict[str, Target], arch: Architecture, spec: ModelSpec) -> int:
    """Fill every target from the checkpoint; returns the checkpoint's parameter count."""
    loaded: set[str] = set()
    num_full = 0
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
                if shape != target.full_shape():
                    raise ModelLoadError(
                        f"{path.name}: tensor {name!r} has shape {list(shape)}, expected "
                        f"{list(target.full_shape())} for {spec.architecture} with this config.json"
                    )
                if target.zero:
                    target.view.zero_()
                elif target.cut is None:
                    target.view.copy_(f.get_tensor(stored_name))
                else:  # only this rank's rows or columns are read
                    target.view.copy_(target.cut.take(tensor))
                loaded.add(name)
                num_full += math.prod(shape)
    _check_complete(model_dir, targets, loaded, unexpected, spec)
    return num_full


@contextlib.contextmanager
def stored_weight(model_dir: str | Path, module: str) -> Iterator[Any]:
    """The checkpoint's lazy slice (``safe_open``'s ``get_slice``) of global module ``module``'s weight
    (``embed_tokens`` or ``lm_head``, as ``BaseShapes`` names them; a tied head's is the embedding's), None
    where no file holds it."""
    model_dir = Path(model_dir)
    arch, spec = load_spec(model_dir)
    module = EMBED_TOKENS if module == "embed_tokens" or spec.tie_word_embeddings else module
    wanted = {f"{hf}.weight" for hf, _, _ in arch.rules.checkpoint_parts(module)}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            stored = next((k for k in f.keys() if arch.rules.canonical(k) in wanted), None)
            if stored is not None:
                yield f.get_slice(stored)
                return
    yield None


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
