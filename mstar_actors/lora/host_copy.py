"""The host copy of an adapter: one safetensors blob, written by the
adapter-reader into a shared-memory segment and read by every worker.

Layout: tensor keys ``<hf_module>.lora_A`` ([r, in]) and ``<hf_module>.lora_B``
([out, r]) for every module ``AdapterWeights.iter_modules`` yields
(``model.layers.3.self_attn.k_proj``, ``model.embed_tokens``, ``lm_head``);
the safetensors metadata (string to string) holds ``format``, ``name``,
``digest``, ``max_rank``, ``num_layers`` and ``scales`` (a JSON object of
hf_module -> float). The scale travels as ``repr`` of the float inside JSON,
which round-trips exactly, so a worker's install equals the reader's
validated weights bit for bit.

The blob was validated by ``read_adapter`` before it was written; decoding
re-checks only the framing (keys, pairs, metadata), so a torn or foreign
segment is refused by name instead of installing garbage.

Pure: bytes in, bytes out; no shared memory, no device.
"""

from __future__ import annotations

import json
import math
import re
import warnings

import torch
from safetensors.torch import save as _st_save

from mstar_actors.lora.adapter_file import AdapterWeights, LoraModule

FORMAT = "mstar-lora-host/1"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GLOBAL_NAMES = {"model.embed_tokens": "embed_tokens", "lm_head": "lm_head"}


class HostCopyError(ValueError):
    """A host-copy blob that can't be decoded; names the adapter and what is wrong."""


def adapter_to_bytes(weights: AdapterWeights) -> bytes:
    """Serialise ``weights`` into one safetensors blob (see the module doc)."""
    tensors: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    for hf_module, module in weights.iter_modules():
        tensors[f"{hf_module}.lora_A"] = _own_storage(module.a)
        tensors[f"{hf_module}.lora_B"] = _own_storage(module.b)
        scales[hf_module] = float(module.scale)
    metadata = {
        "format": FORMAT,
        "name": weights.name,
        "digest": weights.digest,
        "max_rank": str(weights.max_rank),
        "num_layers": str(len(weights.layers)),
        "scales": json.dumps(scales),
    }
    return _st_save(tensors, metadata=metadata)


def adapter_from_bytes(buf: bytes | bytearray | memoryview, *, copy: bool = True) -> AdapterWeights:
    """Decode a blob written by ``adapter_to_bytes``. Raises HostCopyError.

    The tensors are views of the blob, never copies. A ``bytes`` blob
    (immutable, and kept alive by the tensors) is used as is; any other
    buffer is copied into ``bytes`` first, so it may be unmapped right
    after, unless ``copy=False``: then the tensors are views of ``buf``
    itself, which the caller keeps mapped and unchanged while they live (a
    worker's install reads the reader's segment in place: no copy of the
    whole adapter before the one into the device staging). Don't write into
    the returned tensors.
    """
    data = buf if isinstance(buf, bytes) or not copy else bytes(buf)
    metadata = _read_metadata(data)
    name = metadata["name"]
    try:
        tensors = _views(data)
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        raise HostCopyError(f"adapter {name!r}: host copy is corrupt ({err})") from None
    num_layers, scales = _parse_counts(metadata, name)
    layers: list[dict[str, LoraModule]] = [dict() for _ in range(num_layers)]
    global_modules: dict[str, LoraModule] = {}
    for hf_module, scale in scales.items():
        module = LoraModule(a=_take(tensors, hf_module, "A", name), b=_take(tensors, hf_module, "B", name), scale=scale)
        _place(hf_module, module, layers, global_modules, name)
    if tensors:
        raise HostCopyError(
            f"adapter {name!r}: host copy has tensors {sorted(tensors)[:4]} with no scale in its metadata; "
            "accepted: blobs written by adapter_to_bytes"
        )
    return AdapterWeights(
        name=name,
        digest=metadata["digest"],
        max_rank=int(metadata["max_rank"]),
        layers=tuple(layers),
        global_modules=global_modules,
    )


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _views(data: bytes) -> dict[str, torch.Tensor]:
    """The blob's tensors as views of ``data`` (safetensors layout: u64 header
    length, JSON header of dtype / shape / data_offsets, then the data)."""
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + header_len]))
    base = 8 + header_len
    tensors = {}
    with warnings.catch_warnings():  # bytes are read-only; the views are only read
        warnings.simplefilter("ignore", UserWarning)
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype, shape, (begin, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
            count = math.prod(shape)
            if not 0 <= begin <= end <= len(data) - base or end - begin != count * dtype.itemsize:
                raise ValueError(f"tensor {key!r}: data_offsets {begin}..{end} do not fit {shape} {info['dtype']} "
                                 f"in {len(data) - base} data bytes")
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=base + begin) if count else \
                torch.empty(0, dtype=dtype)
            tensors[key] = flat.view(shape)
    return tensors


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """safetensors refuses tensors sharing storage; a view of a larger
    tensor is copied, anything else is saved as is."""
    tensor = tensor.detach().contiguous()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def _read_metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise HostCopyError(f"host copy is {len(data)} bytes, too short for a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if 8 + header_len > len(data):
        raise HostCopyError(f"host copy is truncated: header needs {8 + header_len} bytes, the blob has {len(data)}")
    try:
        metadata = json.loads(bytes(data[8 : 8 + header_len])).get("__metadata__") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise HostCopyError(f"host copy has a corrupt safetensors header ({err})") from None
    if metadata.get("format") != FORMAT:
        raise HostCopyError(
            f"host copy format is {metadata.get('format')!r}; accepted: {FORMAT!r} (written by adapter_to_bytes)"
        )
    missing = [k for k in ("name", "digest", "max_rank", "num_layers", "scales") if k not in metadata]
    if missing:
        raise HostCopyError(f"adapter {metadata.get('name')!r}: host copy metadata lacks {missing}")
    return metadata


def _parse_counts(metadata: dict[str, str], name: str) -> tuple[int, dict[str, float]]:
    try:
        num_layers = int(metadata["num_layers"])
        scales = {str(k): float(v) for k, v in json.loads(metadata["scales"]).items()}
        int(metadata["max_rank"])
    except (ValueError, TypeError, AttributeError, json.JSONDecodeError) as err:
        raise HostCopyError(f"adapter {name!r}: host copy metadata is malformed ({err})") from None
    return num_layers, scales


def _take(tensors: dict[str, torch.Tensor], hf_module: str, kind: str, name: str) -> torch.Tensor:
    key = f"{hf_module}.lora_{kind}"
    if key not in tensors:
        raise HostCopyError(f"adapter {name!r}: host copy lacks tensor {key!r} (its metadata lists a scale for it)")
    return tensors.pop(key)


def _place(hf_module: str, module: LoraModule, layers: list, global_modules: dict, name: str) -> None:
    if hf_module in _GLOBAL_NAMES:
        global_modules[_GLOBAL_NAMES[hf_module]] = module
        return
    m = _LAYER_RE.match(hf_module)
    if m is None or int(m.group(1)) >= len(layers):
        raise HostCopyError(
            f"adapter {name!r}: host copy module {hf_module!r} is neither model.layers.N.<module> "
            f"with N < {len(layers)} nor one of {sorted(_GLOBAL_NAMES)}"
        )
    layers[int(m.group(1))][m.group(2)] = module
