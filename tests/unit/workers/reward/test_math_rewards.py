"""The math rewards: 'math' credits any answer math-verify finds in the text; 'math-strict' only the final answer
in its strict form, the last \\boxed{} or else the last stated number."""

from __future__ import annotations

import pytest

from workers.reward.functions import answer_key, load, stated_answer


@pytest.mark.parametrize(
    "completion,answer",
    [
        ("The final answer is 9 - 3 = 5", "5"),
        ("9 - 3 = 6. So she has 6 apples.", "6"),
        ("First 2 + 2 = 4, so \\boxed{4} and then 17 more words 9", "4"),
        ("\\boxed{3} was wrong; \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("He paid 1,250 dollars", "1250"),
        ("It drops to -7 degrees", "-7"),
        ("The share is 3/4", "3/4"),
        ("0.5 of it", "0.5"),
        ("no number here", ""),
        ("\\boxed{12", "12"),  # an unclosed box is no box: the last number
    ],
)
def test_stated_answer_is_the_last_box_else_the_last_number(completion: str, answer: str) -> None:
    assert stated_answer(completion) == answer


@pytest.mark.parametrize(
    "completion,gold,strict,loose",
    [
        ("The final answer is 9 - 3 = 5", "6", 0.0, 1.0),  # math-verify finds 9 - 3 in the text
        ("9 - 3 = 6", "6", 1.0, 1.0),
        ("Half of it: \\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
        ("\\boxed{7}, or maybe 8", "7", 1.0, 1.0),
        ("so 3 + 4, which is 8", "7", 0.0, 0.0),
        ("I cannot tell", "7", 0.0, 0.0),
    ],
)
def test_math_strict_scores_only_the_stated_answer(completion: str, gold: str, strict: float, loose: float) -> None:
    assert load("math-strict")("", completion, {"answer": gold})[0] == strict
    assert load("math")("", completion, {"answer": gold})[0] == loose


def test_math_strict_votes_on_the_stated_answer() -> None:
    key = answer_key("math-strict")
    assert key("9 - 3 = 6") == key("so \\boxed{6.0}") == key("\\boxed{\\frac{12}{2}}") == "6"
    assert key("The final answer is 9 - 3 = 5") == "5" and key("none") == ""
