"""Tasks by name or by file: `arith` (the demo), `chain` (long chains of thought), `code` (programs run against
tests), `wordmath` (word problems for a pretrained chat model), or your own.

`data.task` is a built-in name, `path/to/file.py:ClassName` or `package.module:ClassName`.
"""

from __future__ import annotations

from functools import cache

from workers.plugins import load_class
from workers.tasks.arith import Arith
from workers.tasks.base import EOS_TEXT, DemoRecipe, Problem, Task
from workers.tasks.chain import Chain
from workers.tasks.code import Code, CodePartial
from workers.tasks.wordmath import WordMath

BUILTIN: dict[str, type[Task]] = {
    "arith": Arith,
    "chain": Chain,
    "code": Code,
    "code-partial": CodePartial,
    "wordmath": WordMath,
}

__all__ = ["BUILTIN", "EOS_TEXT", "DemoRecipe", "Problem", "Task", "load_task"]


@cache
def load_task(spec: str) -> Task:
    """The task named by `spec`, or ValueError saying why it cannot be used."""
    return load_class(spec, Task, "data.task", BUILTIN)()
