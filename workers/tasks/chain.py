"""`chain`, long chains of thought: add d to a number n times, writing each addition out with the steps left.

    prompt      "17+6x4:"
    completion  "3:17+6=23,2:23+6=29,1:29+6=35,0:35+6=41;\\boxed{41}"

Every step is the same small skill, and every decision is local: count the steps left one
down, copy the total just written, add the digit d written right beside it, stop at 0.
Writing the operands out is what makes the addition learnable by a small model (measured:
with only the totals, "3:23,2:29,...", a 2.2M-parameter model's warm-up reached 18 % held-out
in 775 steps; written out, 84 % in 800 and 96 % in 1,400), because the digits it adds sit
at fixed distances before the "=". But n varies per problem with a long tail (log-normal,
1 to 25 steps), so worked solutions run from ~20 to ~330 tokens with p90/p50 ≈ 4.6, like
reasoning traces. An error anywhere derails the rest, so long problems are the hard ones,
and RL has a long tail to hide. The reward is 1 only when the final \\boxed{} answer equals
the reference (math-verify); the answer a + n·d cannot be read off the prompt without the
arithmetic, so a chain of garbage that ends in a lucky guess is rare.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re

from workers.tasks.base import EOS_TEXT, DemoRecipe, Problem, Task

MAX_STEPS = 25  # 25 written-out steps are ~330 tokens
MEDIAN_STEPS = 3.0
STEPS_SIGMA = 1.3  # of log(steps): p90 / p50 of the steps is exp(1.28 * sigma) ≈ 5.3
FORGET_CARRY = 0.6  # the warm-up teacher's mistake: more often wrong than right, so greedy decoding inherits it
TRAIN_ROWS = 20_000  # training problems drawn per seed (a short one may repeat: there are few of them)
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def worked_solution(start: int, step: int, count: int) -> str:
    lines = (f"{count - i}:{start + step * (i - 1)}+{step}={start + step * i}" for i in range(1, count + 1))
    return ",".join(lines) + f";\\boxed{{{start + step * count}}}"


def operands(prompt: str) -> tuple[int, int, int]:
    """(start, step, count) of a prompt "17+6x4:"."""
    start, rest = prompt.rstrip(":").split("+")
    step, count = rest.split("x")
    return int(start), int(step), int(count)


def teacher_solution(start: int, step: int, count: int, rng: random.Random) -> str:
    """A worked solution by a teacher that forgets the carry with probability FORGET_CARRY and goes on from
    its wrong total to its own boxed answer: a consistent chain, wrong wherever a carry was forgotten."""
    total, lines = start, []
    for left in range(count - 1, -1, -1):
        carry = total % 10 + step >= 10
        new = total + step - (10 if carry and rng.random() < FORGET_CARRY else 0)
        lines.append(f"{left}:{total}+{step}={new}")
        total = new
    return ",".join(lines) + f";\\boxed{{{total}}}"


def draw(rng: random.Random) -> Problem:
    """One problem whose solution takes a log-normal number of steps."""
    count = min(MAX_STEPS, max(1, round(math.exp(rng.gauss(math.log(MEDIAN_STEPS), STEPS_SIGMA)))))
    start, step = rng.randint(1, 99), rng.randint(2, 9)
    return Problem(f"{start}+{step}x{count}:", str(start + step * count), worked_solution(start, step, count))


class Chain(Task):
    name = "chain"
    alphabet = "0123456789+x:,;=\\boxed{}"
    max_new_tokens = 400
    demo = DemoRecipe(
        hidden_size=192,
        layers=4,
        heads=4,
        kv_heads=2,
        positions=432,
        warmup_rows=19_000,
        probe_rows=200,
        warmup_batch=32,
        warmup_lr=1e-3,
        warmup_target=0.15,
        warmup_max_steps=1200,
        probe_every=25,
        length_buckets=16,
    )

    def split(self, seed: int, held_out: int) -> tuple[list[Problem], list[Problem]]:
        """Distinct held-out problems first, then training draws that never repeat a held-out prompt.

        Drawn rather than enumerated, so the log-normal length distribution holds in both sets.
        """
        rng, held = random.Random(f"chain/{seed}"), {}
        while len(held) < held_out:
            problem = draw(rng)
            held.setdefault(problem.prompt, problem)
        train = []
        while len(train) < TRAIN_ROWS:
            problem = draw(rng)
            if problem.prompt not in held:
                train.append(problem)
        return train, list(held.values())

    def demonstrations(self, rows: list[Problem], seed: int) -> list[Problem]:
        """The demo model learns from a flawed teacher (as a model distilled from a weaker one does): it forgets
        the carry 60 % of the time. Greedy decoding inherits the mistake; sampling finds the carry 40 % of the
        time, and the verifier's reward tells which, so RL has a real mistake to unlearn."""
        rng = random.Random(f"chain-teacher/{seed}")
        return [dataclasses.replace(p, solution=teacher_solution(*operands(p.prompt), rng)) for p in rows]

    def final_answer(self, completion: str) -> str:
        """The last \\boxed{...} before the end token; '' when there is none."""
        found = BOXED.findall(completion.split(EOS_TEXT, 1)[0])
        return found[-1].strip() if found else ""

    def score(self, completion: str, answer: str) -> float:
        """math-verify's verdict on the final answer. Two digit strings are compared as integers first, which is
        that verdict (tests/unit/workers/tasks/test_chain.py checks it) without sympy: parsing both took ~1-4 ms a call,
        half of the reward worker's CPU on this task, whose references are all digit strings."""
        from math_verify import parse, verify

        final = self.final_answer(completion)
        if not final:
            return 0.0
        if final.isascii() and final.isdigit() and answer.isascii() and answer.isdigit():
            return 1.0 if int(final) == int(answer) else 0.0
        gold, predicted = parse(answer), parse(final)
        return 1.0 if gold and predicted and verify(gold, predicted) else 0.0
