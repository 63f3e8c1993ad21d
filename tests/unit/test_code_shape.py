"""The code's shape: no function over 60 lines, and each worker's loop at most 50, so that it reads on one screen.

A function's length runs from its `def` line to its last line (`end_lineno - lineno + 1`, decorators not
counted). By hand: `python -m pytest -q tests/unit/test_code_shape.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "topics", "workers", "pipeline")
MAX_FUNCTION_LINES = 60
MAX_LOOP_LINES = 50

# role -> "module:function", the function that holds the role's `while` / `async for` loop
WORKER_LOOPS = {
    "prompt source": "workers.prompt_source:main",
    "rollout": "workers.rollout.worker:generate",
    "reward": "workers.reward.worker:main",
    "trainer": "workers.trainer.worker:lead",
    "evaluator": "workers.evaluator.worker:main",
}

Function = ast.FunctionDef | ast.AsyncFunctionDef


def functions(tree: ast.AST) -> list[Function]:
    """Every function and method of `tree`, nested ones included."""
    return [node for node in ast.walk(tree) if isinstance(node, Function)]


def lines(function: Function) -> int:
    return function.end_lineno - function.lineno + 1


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_over_60_lines(package: str) -> None:
    too_long = [
        f"{path.relative_to(ROOT)}:{function.name}:{lines(function)}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for function in functions(ast.parse(path.read_text(), str(path)))
        if lines(function) > MAX_FUNCTION_LINES
    ]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(too_long)}"


@pytest.mark.parametrize("role", WORKER_LOOPS)
def test_each_worker_loop_is_at_most_50_lines(role: str) -> None:
    module, name = WORKER_LOOPS[role].split(":")
    path = ROOT / (module.replace(".", "/") + ".py")
    found = [f for f in ast.parse(path.read_text(), str(path)).body if isinstance(f, Function) and f.name == name]
    assert found, f"{role}: no top-level function {name} in {path.relative_to(ROOT)}"
    (function,) = found
    assert any(isinstance(node, ast.While | ast.AsyncFor) for node in ast.walk(function)), (
        f"{role}: {module}:{name} holds no while / async for loop: the table names the wrong function"
    )
    assert lines(function) <= MAX_LOOP_LINES, f"{role}: {path.relative_to(ROOT)}:{name}:{lines(function)}"
