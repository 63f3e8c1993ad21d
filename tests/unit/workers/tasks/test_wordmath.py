"""wordmath: distinct word problems of 1 to 4 steps with whole-number answers, the same set on every machine,
scored by the boxed answer or else the last number."""

import pytest

from workers.tasks import load_task
from workers.tasks.wordmath import INSTRUCTION, PROBLEMS


@pytest.fixture(scope="module")
def task():
    return load_task("wordmath")


def test_problems_are_distinct_varied_and_fixed(task):
    problems = task.problems(0)
    assert len({p.prompt for p in problems}) == len(problems) == PROBLEMS
    assert [p.prompt for p in problems[:50]] == [p.prompt for p in task.problems(7)[:50]]  # not the run's seed
    assert {p.metadata["steps"] for p in problems} == {"1", "2", "3", "4"}
    assert all(p.prompt.endswith(INSTRUCTION) and int(p.answer) >= 1 for p in problems)
    assert len({p.prompt.split(".")[1] for p in problems}) > 50  # the steps are said in many ways


def test_the_split_is_seeded_and_disjoint(task):
    train, held_out = task.split(0, 200)
    assert len(held_out) == 200 and not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert task.split(0, 200)[1] == held_out and task.split(1, 200)[1] != held_out


@pytest.mark.parametrize(
    "completion, score, answer",
    [
        ("She has 12 + 5 = 17, then 17 - 3 = 14. The answer is 14.", 1.0, "14"),
        ("\\boxed{14}", 1.0, "14"),
        ("So \\boxed{14}, or maybe 15", 1.0, "14"),  # the boxed answer wins over a later number
        ("\\boxed{15} ... 14", 0.0, "15"),
        ("12 + 5 - 3", 0.0, "3"),  # an expression scores by its last number
        ("She has 1,014 left... no, 14.0", 1.0, "14"),
        ("no idea", 0.0, ""),
    ],
)
def test_the_verifier_takes_the_boxed_answer_else_the_last_number(task, completion, score, answer):
    assert task.score(completion, "14") == score and task.final_answer(completion) == answer
