"""`code`, programs checked by running them: compose 1 to 3 integer operations named in words into a function.

    prompt      "add 3, times 2\n"
    completion  "def f(x):\n x=x+3\n x=x*2\n return x"

The operations (add K, sub K, times K, square, negate, halve, mod K) are each one line of code, and the
function applies them in the order the prompt names them. Every composition of two or three is one whose
order matters: written backwards it is another function, and so is every other order that is, as the hidden
tests tell (5 inputs, negatives and 0 among them). The verifier runs the completion against those tests in
the sandbox (`workers/sandbox/code.py`: one execution per completion), so any program that computes the
function passes, not only the worked one.

The prompt is the specification alone. Measured with two input/output examples after it
("add 3, times 2; f(2)=10 f(9)=24"): they tell the model nothing the words do not, and its warm-up wrote
60 % of held-out problems in one order or the other after 800 steps, against 79 % after 500 without them
(and each step cost 1.5 times as much).

The reference (`Problem.answer`) is the worked solution itself, so that `final_answer` (the code) of a right
completion is the answer; the tests follow from it (`hidden_tests`), and the rows carry them as `tests` too,
the field `data.reward=code` reads. `Code.partial` (the `code-partial` task) gives the share of tests passed.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

from workers.sandbox.bwrap import Limits
from workers.sandbox.code import check_asserts
from workers.tasks.base import EOS_TEXT, DemoRecipe, Problem, Task

TEST_INPUTS = (-7, -2, 0, 5, 12)  # the hidden tests' inputs
WIDE = range(-40, 41)  # two compositions equal on all of these count as the same function
THREE_OPS = 2000  # compositions of three operations kept, of the ~27,000 whose order matters
REVERSE = 0.6  # the warm-up teacher's mistake: more often wrong than right, so greedy decoding inherits it
HEADER, FOOTER = "def f(x):", " return x"
LIMITS = Limits(cpu_s=1.0, wall_s=3.0, memory_mb=128, processes=4, file_mb=1, open_files=32, output_bytes=16384)


@dataclass(frozen=True)
class Op:
    words: str  # as the prompt names it: "add 3"
    line: str  # as the function writes it: "x=x+3"
    apply: Callable[[int], int]


def operations() -> tuple[Op, ...]:
    """The 33 operations: add/sub K (1..9), times K (2..5), square, negate, halve, mod K (2..9)."""
    return (
        *(Op(f"add {k}", f"x=x+{k}", lambda x, k=k: x + k) for k in range(1, 10)),
        *(Op(f"sub {k}", f"x=x-{k}", lambda x, k=k: x - k) for k in range(1, 10)),
        *(Op(f"times {k}", f"x=x*{k}", lambda x, k=k: x * k) for k in range(2, 6)),
        Op("square", "x=x*x", lambda x: x * x),
        Op("negate", "x=-x", operator.neg),
        Op("halve", "x=x//2", lambda x: x // 2),
        *(Op(f"mod {k}", f"x=x%{k}", lambda x, k=k: x % k) for k in range(2, 10)),
    )


OPS = operations()
BY_LINE = {op.line: op for op in OPS}


def run(ops: Sequence[Op], x: int) -> int:
    for op in ops:
        x = op.apply(x)
    return x


def outputs(ops: Sequence[Op], inputs: Sequence[int]) -> tuple[int, ...]:
    return tuple(run(ops, x) for x in inputs)


def solution(ops: Sequence[Op]) -> str:
    return "\n".join([HEADER, *(f" {op.line}" for op in ops), FOOTER])


def parse(code: str) -> list[Op] | None:
    """The operations of a worked solution (the reference), or None when it is not one."""
    lines = code.split("\n")
    if len(lines) < 3 or lines[0] != HEADER or lines[-1] != FOOTER:
        return None
    ops = [BY_LINE.get(line.removeprefix(" ")) for line in lines[1:-1]]
    return None if None in ops or not all(line.startswith(" ") for line in lines[1:-1]) else ops


def hidden_tests(ops: Sequence[Op]) -> str:
    """The hidden tests: one assert per input of TEST_INPUTS."""
    return "\n".join(f"assert f({x})=={y}" for x, y in zip(TEST_INPUTS, outputs(ops, TEST_INPUTS), strict=True))


def order_matters(ops: tuple[Op, ...]) -> bool:
    """Written backwards it is another function, and the tests tell every other order that is one apart."""
    if len(ops) == 1:
        return True
    wide = outputs(ops, WIDE)
    if outputs(ops[::-1], WIDE) == wide:
        return False
    tests = outputs(ops, TEST_INPUTS)
    others = (order for order in itertools.permutations(ops) if outputs(order, WIDE) != wide)
    return all(outputs(order, TEST_INPUTS) != tests for order in others)


def problem(ops: tuple[Op, ...]) -> Problem:
    code = solution(ops)
    return Problem(", ".join(op.words for op in ops) + "\n", code, code, {"tests": hidden_tests(ops)})


@cache
def every_problem() -> tuple[Problem, ...]:
    """Every single operation, every pair and THREE_OPS triples (a fixed draw) whose order matters (made once per
    process: about a second)."""
    pairs = [ops for ops in itertools.product(OPS, repeat=2) if order_matters(ops)]
    triples = random.Random("code/triples").sample(list(itertools.product(OPS, repeat=3)), 4 * THREE_OPS)
    triples = [ops for ops in triples if order_matters(ops)][:THREE_OPS]
    return tuple(problem(ops) for ops in [*((op,) for op in OPS), *pairs, *triples])


def teacher_solution(problem: Problem, rng: random.Random) -> str:
    """The worked solution by a teacher that reads the composition backwards (f∘g as "f, then g") with
    probability REVERSE: a consistent program, wrong wherever the order matters."""
    ops = parse(problem.solution)
    return solution(ops[::-1] if rng.random() < REVERSE else ops)


class Code(Task):
    name = "code"
    alphabet = "0123456789 ,:=()-+*/%\nabdefghilmnoqrstuvx"
    max_new_tokens = 64
    partial: ClassVar[bool] = False  # the share of tests passed rather than all or nothing
    demo = DemoRecipe(  # measured here: written in one order or the other, 0.5 of the probe by step 200, 0.8 by 500
        positions=128,
        warmup_rows=2300,
        probe_rows=200,
        warmup_batch=32,
        warmup_lr=1e-3,
        warmup_target=0.4,  # in the right order; the teacher's 60 % backwards keeps it below that, so ...
        warmup_max_steps=500,  # ... warm-up normally ends here
        probe_every=25,
    )

    def problems(self, seed: int) -> list[Problem]:
        return list(every_problem())

    def demonstrations(self, rows: list[Problem], seed: int) -> list[Problem]:
        """The demo model learns from a flawed teacher that writes the operations backwards 60 % of the time.
        Greedy decoding inherits it (and mixes the two orders up: the operations one way, their numbers the other);
        measured after warm-up, 26 % of samples are right, 70 % of problems at least once in 8, and the tests tell
        which."""
        rng = random.Random(f"code-teacher/{seed}")
        return [dataclasses.replace(p, solution=teacher_solution(p, rng)) for p in rows]

    def final_answer(self, completion: str) -> str:
        """The code up to the end token, blank lines and trailing spaces dropped: equal programs vote together."""
        lines = completion.split(EOS_TEXT, 1)[0].rstrip().split("\n")
        return "\n".join(line.rstrip() for line in lines if line.strip())

    def score(self, completion: str, answer: str) -> float:
        """The tests of the reference `answer` run against the completion in the sandbox; 0.0 when the reference is
        no worked solution (nothing to test against). Garbage from the model is a 0.0 like any failed test; only a
        host that cannot run the sandbox raises (SandboxError, which pre-flight reports in one line)."""
        ops = parse(answer)
        if ops is None:
            return 0.0
        verdict = check_asserts(completion.split(EOS_TEXT, 1)[0], hidden_tests(ops), LIMITS)
        return verdict.reward(self.partial)


class CodePartial(Code):
    name = "code-partial"
    partial = True
