"""What every task promises (built-ins and a user's file): the pipeline, the demo model and evaluation rely on it."""

from __future__ import annotations

import textwrap

import pytest

from pipeline.config import ConfigError, load_config, resolve
from workers.tasks import BUILTIN, EOS_TEXT, Task, load_task

USER_TASK = """
from workers.tasks import Problem, Task


class Echo(Task):
    name = "echo"
    alphabet = "abc0123456789="
    max_new_tokens = 4

    def problems(self, seed):
        return [Problem(f"a{i}=", str(i), str(i)) for i in range(50)]

    def score(self, completion, answer):
        return 1.0 if self.final_answer(completion) == answer else 0.0
"""


@pytest.fixture
def user_task_spec(tmp_path) -> str:
    path = tmp_path / "my_task.py"
    path.write_text(textwrap.dedent(USER_TASK))
    return f"{path}:Echo"


def every_task(user_spec: str) -> list[Task]:
    return [load_task(name) for name in BUILTIN] + [load_task(user_spec)]


def test_split_is_seeded_disjoint_and_sized(user_task_spec):
    for task in every_task(user_task_spec):
        train, held_out = task.split(3, 20)
        assert len(held_out) == 20 and len({p.prompt for p in held_out}) == 20, task.name
        assert not {p.prompt for p in train} & {p.prompt for p in held_out}, task.name
        assert task.split(3, 20) == (train, held_out), task.name
        assert task.split(4, 20)[1] != held_out, task.name


def test_worked_solutions_are_right_and_other_answers_wrong(user_task_spec, bubblewrap):
    for task in every_task(user_task_spec):
        train, held_out = task.split(0, 20)
        for problem in train[:50] + held_out:
            assert task.score(problem.solution + EOS_TEXT, problem.answer) == 1.0, (task.name, problem)
            assert task.final_answer(problem.solution + EOS_TEXT + "junk") == problem.answer, (task.name, problem)
            assert task.score(problem.solution + EOS_TEXT, problem.answer + "1") == 0.0, (task.name, problem)
        assert task.score("", train[0].answer) == 0.0


def test_demo_model_can_hold_and_spell_every_problem(user_task_spec):
    """The demo tokenizer is the alphabet (no unknown characters); positions hold prompt + longest completion."""
    for task in every_task(user_task_spec):
        train, held_out = task.split(0, 20)
        for problem in train + held_out:
            assert set(problem.prompt + problem.solution) <= set(task.alphabet), (task.name, problem)
            assert len(problem.solution) + 1 <= task.max_new_tokens, (task.name, problem)
            assert len(problem.prompt) + task.max_new_tokens <= task.demo.positions, (task.name, problem)


def test_a_user_task_file_runs_by_path(user_task_spec):
    from pipeline.launch.run_dir import check_dataset
    from workers.rows import load_rows

    config = resolve(load_config(None, [f"data.task={user_task_spec}", "data.held_out=10"]))
    assert config.rollout.max_new_tokens == 4  # the task's default
    rows, bad = load_rows(config)
    assert not bad and len(rows) == 40 and {r.prompt for r in rows} <= {f"a{i}=" for i in range(50)}
    too_many = resolve(load_config(None, [f"data.task={user_task_spec}", "data.held_out=50"]))
    with pytest.raises(ConfigError, match="held_out=50 leaves no training problem"):
        check_dataset(too_many)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("nosuch", "use arith, chain"),
        ("missing_file.py:Echo", "cannot be loaded"),
        ("json:JSONDecoder", "not a subclass"),
    ],
)
def test_a_bad_task_is_a_one_line_config_error(spec, says):
    with pytest.raises(ConfigError, match=says):
        resolve(load_config(None, [f"data.task={spec}"]))
