"""Plug-ins named in the config: a class by `path/to/file.py:Class` or `package.module:Class`.

One loader for every plug-in point that takes a class (tasks, rollout workflows), so that each says
the same thing when the name is wrong.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def load_class(spec: str, base: type[T], field: str, builtin: dict[str, type[T]]) -> type[T]:
    """The subclass of `base` that `spec` names (a key of `builtin` or a path), or ValueError saying why not."""
    if spec in builtin:
        return builtin[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"{field} {spec!r}: use {', '.join(builtin)}, path/to/file.py:Class or module:Class")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            module_spec = importlib.util.spec_from_file_location(f"asyncrl_plugin_{path.stem}", path)
            if module_spec is None or not path.is_file():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        cls = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as exc:
        raise ValueError(f"{field} {spec!r} cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{field} {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls
