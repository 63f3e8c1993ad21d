"""The `code` task without the sandbox: its problems, worked solutions, hidden tests and flawed teacher."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config, resolve
from tests.unit.workers.tasks.fixed_draws import Draws
from workers.rows import load_rows
from workers.tasks import EOS_TEXT
from workers.tasks.code import (
    OPS,
    TEST_INPUTS,
    Code,
    hidden_tests,
    outputs,
    parse,
    solution,
    teacher_solution,
)

CODE = Code()
ADD3, TIMES2 = (next(op for op in OPS if op.words == words) for words in ("add 3", "times 2"))


def test_a_problem_as_the_model_sees_it():
    problem = next(p for p in CODE.problems(0) if p.prompt == "add 3, times 2\n")
    assert problem.solution == problem.answer == "def f(x):\n x=x+3\n x=x*2\n return x"
    assert (
        problem.metadata["tests"]
        == hidden_tests([ADD3, TIMES2])
        == ("assert f(-7)==-8\nassert f(-2)==2\nassert f(0)==6\nassert f(5)==16\nassert f(12)==30")
    )


def test_worked_solutions_parse_back_and_nothing_else_does():
    assert parse(solution([ADD3, TIMES2])) == [ADD3, TIMES2]
    for broken in ("", "def f(x):\n return x", "def f(x):\n x=x+3\n return x1", "def f(x):\nx=x+3\n return x"):
        assert parse(broken) is None


def test_every_problem_is_distinct_and_its_order_matters():
    problems = CODE.problems(0)
    sizes = [len(parse(p.answer)) for p in problems]
    assert len({p.prompt for p in problems}) == len(problems) and {sizes.count(n) for n in (1, 2, 3)} == {33, 706, 2000}
    for problem in problems:
        ops = parse(problem.answer)
        assert problem.prompt == ", ".join(op.words for op in ops) + "\n"
        if len(ops) > 1:  # the teacher's mistake is one, and the tests tell it
            assert outputs(ops[::-1], TEST_INPUTS) != outputs(ops, TEST_INPUTS)


def test_the_warm_up_teacher_writes_the_operations_backwards():
    problem = next(p for p in CODE.problems(0) if p.prompt == "add 3, times 2\n")
    assert teacher_solution(problem, Draws(1.0)) == problem.solution
    assert teacher_solution(problem, Draws(0.0)) == "def f(x):\n x=x*2\n x=x+3\n return x"
    train, _ = CODE.split(0, 200)
    shown = CODE.demonstrations(train, seed=0)
    assert [(p.prompt, p.answer) for p in shown] == [(p.prompt, p.answer) for p in train]
    multi = [(p, q) for p, q in zip(shown, train, strict=True) if len(parse(q.answer)) > 1]
    assert 0.55 < sum(p.solution != q.solution for p, q in multi) / len(multi) < 0.65
    assert CODE.demonstrations(train[:50], seed=0) == shown[:50]  # seeded


def test_final_answer_is_the_code_before_the_end():
    assert CODE.final_answer("def f(x):  \n\n x=-x\n return x\n" + EOS_TEXT + "junk") == "def f(x):\n x=-x\n return x"


def test_the_rows_carry_their_tests_for_data_reward_code():
    config = resolve(load_config(None, ["data.task=code", "data.reward=code"]))
    rows, bad = load_rows(config)
    assert not bad and all(row.metadata["tests"] == hidden_tests(parse(row.answer)) for row in rows)
    with pytest.raises(
        ConfigError, match=r"use builtin, math, math-strict, code, path/to/file\.py:function or module:function"
    ):
        resolve(load_config(None, ["data.reward=nosuch"]))
