"""Plug-ins named in the config: `path/to/file.py:Name` or `package.module:Name`.

One loader for every plug-in point (tasks, rollout workflows, reward functions), so that each finds a
module the same way and says the same thing when the name is wrong. A module name is looked up as the
run's workers (started with `python -m`) look it up: a module in the current directory imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")


def load_class(spec: str, base: type[T], field: str, builtin: dict[str, type[T]]) -> type[T]:
    """The subclass of `base` that `spec` names (a key of `builtin` or a path), or ValueError saying why not."""
    if spec in builtin:
        return builtin[spec]
    cls = load_attribute(spec, field, f"{', '.join(builtin)}, path/to/file.py:Class or module:Class")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{field} {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def load_attribute(spec: str, field: str, forms: str) -> Any:
    """What `path/to/file.py:name` or `module:name` names, or ValueError saying why not (`forms`: what `field`
    takes, for the message)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"{field} {spec!r}: use {forms}")
    try:
        return getattr(import_file(Path(where)) if where.endswith(".py") else import_beside(where), name)
    except (ImportError, AttributeError, SyntaxError) as exc:
        raise ValueError(f"{field} {spec!r} cannot be loaded: {exc}") from exc


def import_file(path: Path) -> ModuleType:
    path = path.resolve()
    module_spec = importlib.util.spec_from_file_location(f"asyncrl_plugin_{path.stem}", path)
    if module_spec is None or not path.is_file():
        raise ImportError(f"no file {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def import_beside(name: str) -> ModuleType:
    """`name` imported with the current directory first on the path, as under `python -m`."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(name)
