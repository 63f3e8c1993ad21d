"""Tasks by name or by file: `arith` (the demo), `chain` (long chains of thought), or your own.

`data.task` is a built-in name, `path/to/file.py:ClassName` or `package.module:ClassName`.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from pathlib import Path

from workers.tasks.arith import Arith
from workers.tasks.base import EOS_TEXT, DemoRecipe, Problem, Task
from workers.tasks.chain import Chain

BUILTIN: dict[str, type[Task]] = {"arith": Arith, "chain": Chain}

__all__ = ["BUILTIN", "EOS_TEXT", "DemoRecipe", "Problem", "Task", "load_task"]


@cache
def load_task(spec: str) -> Task:
    """The task named by `spec`, or ValueError saying why it cannot be used."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"data.task {spec!r}: use {', '.join(BUILTIN)}, path/to/file.py:Class or module:Class")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            module_spec = importlib.util.spec_from_file_location(f"asyncrl_task_{path.stem}", path)
            if module_spec is None or not path.is_file():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        cls = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as exc:
        raise ValueError(f"data.task {spec!r} cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"data.task {spec!r} is not a subclass of workers.tasks.Task")
    return cls()
