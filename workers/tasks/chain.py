"""`chain`, long chains of thought: start at a, add d until the total passes T, one line per addition.

    prompt      "17+6>40:"
    completion  "17+6=23\n23+6=29\n29+6=35\n35+6=41\n\\boxed{41}"

Every step is the same small skill (add a digit, compare with the bound), but the number of
steps varies per problem with a long tail (log-normal, 1 to 24 steps), so worked solutions
run from ~18 to ~240 tokens with p90/p50 ≈ 4, like reasoning traces. An error anywhere
derails the rest, so long problems are the hard ones, and RL has a long tail to hide. The
reward is 1 only when the final \\boxed{} answer equals the reference (math-verify).
"""

from __future__ import annotations

import math
import random
import re

from workers.tasks.base import EOS_TEXT, DemoRecipe, Problem, Task

MAX_STEPS = 24
MEDIAN_STEPS = 3.0
STEPS_SIGMA = 1.2  # of log(steps): p90 / p50 of the steps is exp(1.28 * sigma) ≈ 4.7
POOL = 20_000  # distinct problems drawn per seed
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def worked_solution(start: int, step: int, bound: int) -> str:
    lines, total = [], start
    while total <= bound:
        lines.append(f"{total}+{step}={total + step}")
        total += step
    return "\n".join([*lines, f"\\boxed{{{total}}}"])


def draw(rng: random.Random) -> Problem:
    """One problem whose solution takes a log-normal number of steps."""
    steps = min(MAX_STEPS, max(1, round(math.exp(rng.gauss(math.log(MEDIAN_STEPS), STEPS_SIGMA)))))
    start, step = rng.randint(1, 99), rng.randint(2, 9)
    bound = rng.randint(start + (steps - 1) * step, start + steps * step - 1)  # passed after exactly `steps`
    return Problem(f"{start}+{step}>{bound}:", str(start + steps * step), worked_solution(start, step, bound))


class Chain(Task):
    name = "chain"
    alphabet = "0123456789+=>:\n\\boxed{}"
    max_new_tokens = 288
    demo = DemoRecipe(
        hidden_size=256,
        layers=4,
        heads=4,
        kv_heads=2,
        positions=320,
        warmup_rows=2000,
        probe_rows=200,
        warmup_batch=32,
        warmup_lr=1e-3,
        warmup_target=0.3,
    )

    def problems(self, seed: int) -> list[Problem]:
        rng, seen, problems = random.Random(f"chain/{seed}"), set(), []
        while len(problems) < POOL:
            problem = draw(rng)
            if problem.prompt not in seen:
                seen.add(problem.prompt)
                problems.append(problem)
        return problems

    def final_answer(self, completion: str) -> str:
        """The last \\boxed{...} before the end token; '' when there is none."""
        found = BOXED.findall(completion.split(EOS_TEXT, 1)[0])
        return found[-1].strip() if found else ""

    def score(self, completion: str, answer: str) -> float:
        from math_verify import parse, verify

        final = self.final_answer(completion)
        if not final:
            return 0.0
        gold, predicted = parse(answer), parse(final)
        return 1.0 if gold and predicted and verify(gold, predicted) else 0.0
