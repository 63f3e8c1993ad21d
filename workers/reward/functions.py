"""Reward functions: the built-in verifiers and the user's own, by import path.

A reward function is `fn(prompt: str, completion: str, metadata: dict[str, str])`
returning a float, or `(float, details: dict)`. `metadata` holds the row's fields
plus "answer". 'builtin' is the task's own verifier; 'math' takes the answer math-verify finds in
the completion, 'math-strict' only the boxed or last stated number (`stated_answer`); 'code' runs the
completion against the row's tests in the sandbox (`workers/sandbox/code.py`). This module runs inside the
scoring processes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from schemas.validate import MAX_ABS_REWARD
from workers.plugins import load_attribute
from workers.sandbox.code import code_reward, extract_code
from workers.tasks import load_task

RewardFn = Callable[[str, str, dict[str, str]], Any]
AnswerKey = Callable[[str], str]


def math_answer(prompt: str, completion: str, metadata: dict[str, str]) -> tuple[float, dict[str, str]]:
    """1.0 when math-verify finds the completion's final answer equal to the reference."""
    from math_verify import parse, verify

    gold, predicted = parse(metadata["answer"]), parse(completion)
    return (1.0 if gold and predicted and verify(gold, predicted) else 0.0), {"parsed": str(predicted[:1])}


LAST_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")  # 12, -3, 1,000, 0.5, 3/4


def stated_answer(completion: str) -> str:
    """A completion's final answer in the strict form: the content of its last \\boxed{}, else the last number it
    states, else '' (no answer). Nothing else counts: "9 - 3 = 5" answers 5."""
    start = completion.rfind("\\boxed{")
    if start >= 0:
        depth, begin = 0, start + len("\\boxed{")
        for end in range(begin, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[end], 0)
            if depth < 0:
                return completion[begin:end].strip()
    numbers = LAST_NUMBER.findall(completion)
    return numbers[-1].replace(",", "") if numbers else ""


def math_strict(prompt: str, completion: str, metadata: dict[str, str]) -> tuple[float, dict[str, str]]:
    """1.0 when the completion's `stated_answer` equals the reference (math-verify compares the two), where 'math'
    takes any answer-like expression math-verify finds in the text."""
    from math_verify import parse, verify

    answer = stated_answer(completion)
    gold, predicted = parse(metadata["answer"]), parse(f"${answer}$") if answer else []
    return (1.0 if gold and predicted and verify(gold, predicted) else 0.0), {"parsed": str(predicted[:1])}


def load(spec: str, task: str = "arith") -> RewardFn:
    """'builtin' (the verifier of `task`, a data.task spec), 'math', 'math-strict', 'code',
    'path/to/file.py:function' or 'package.module:function'."""
    if spec == "builtin":
        verifier = load_task(task)
        return lambda prompt, completion, metadata: verifier.score(completion, metadata["answer"])
    if spec == "math":
        return math_answer
    if spec == "math-strict":
        return math_strict
    if spec == "code":
        return code_reward
    fn = load_attribute(
        spec, "reward function", "builtin, math, math-strict, code, path/to/file.py:function or module:function"
    )
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


def math_key(completion: str) -> str:
    """math-verify's parse of the completion as a string ('' when it finds no answer); a real number as its
    value to 12 digits, so that 15, 15.0 and 30/2 vote together."""
    from math_verify import parse

    parsed = parse(completion)
    if not parsed:
        return ""
    value = parsed[0]
    if getattr(value, "is_number", False) and getattr(value, "is_real", False):
        try:
            return format(float(value), ".12g")
        except (TypeError, ValueError, OverflowError):
            pass
    return str(value)


def answer_key(spec: str, task: str = "arith") -> AnswerKey:
    """The final answer of a completion as a comparable string, for majority voting (maj@k) beside the
    verifier `load(spec, task)`: the task's `final_answer` ('builtin'), math-verify's parse ('math'), the code
    ('code'), or the stripped completion (a function of your own, whose notion of an answer is unknown here)."""
    if spec == "builtin":
        return load_task(task).final_answer
    if spec == "math":
        return math_key
    if spec == "math-strict":
        return lambda completion: math_key(f"${answer}$") if (answer := stated_answer(completion)) else ""
    if spec == "code":
        return extract_code
    return str.strip


def normalise(result: Any) -> tuple[float, dict[str, str]]:
    """A user's return value as (finite reward, string details), or ValueError saying why not. The bound
    keeps group normalisation finite in float32 (see `schemas.validate.MAX_ABS_REWARD`)."""
    details: dict = {}
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        result, details = result
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise ValueError(f"reward must be a number or (number, dict), got {type(result).__name__}")
    if not math.isfinite(result) or abs(result) > MAX_ABS_REWARD:
        raise ValueError(f"reward must be finite and within ±{MAX_ABS_REWARD:g}, got {result}")
    return float(result), {str(k): str(v) for k, v in details.items()}
