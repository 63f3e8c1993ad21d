"""`chain`, long chains of thought: start at a, add d until the total passes T, writing every sum.

    prompt      "17+6>40:"
    completion  "17+6=23+6=29+6=35+6=41;\\boxed{41}"

Every step is the same small skill (add a digit to the total just written, compare with
the bound), but the number of steps varies per problem with a long tail (log-normal, 1 to
40 steps), so worked solutions run from ~16 to ~250 tokens with p90/p50 ≈ 3.5, like
reasoning traces. An error anywhere
derails the rest, so long problems are the hard ones, and RL has a long tail to hide. The
reward is 1 only when the final \\boxed{} answer equals the reference (math-verify).
"""

from __future__ import annotations

import math
import random
import re

from workers.tasks.base import EOS_TEXT, DemoRecipe, Problem, Task

MAX_STEPS = 49
BOUND = 99
MEDIAN_STEPS = 3.0
STEPS_SIGMA = 1.3  # of log(steps): p90 / p50 of the steps is exp(1.28 * sigma) ≈ 5.3
TRAIN_ROWS = 20_000  # training problems drawn per seed (a short one may repeat: there are few of them)
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def worked_solution(start: int, step: int, bound: int) -> str:
    parts, total = [str(start)], start
    while total <= bound:
        total += step
        parts.append(f"+{step}={total}")
    return "".join(parts) + f";\\boxed{{{total}}}"


def draw(rng: random.Random) -> Problem:
    """One problem whose solution takes a log-normal number of steps.

    The bound is always 99 and a step adds at most 9, so every total but the last has two
    digits and the stop is "the total reached three digits": what the model must get right
    over a long chain is the sums, the skill of `arith`, again and again.
    """
    steps = min(MAX_STEPS, max(1, round(math.exp(rng.gauss(math.log(MEDIAN_STEPS), STEPS_SIGMA)))))
    step = rng.randint(2, max(2, min(9, 98 // steps)))  # a start >= 1 needs exactly `steps` additions
    steps = min(steps, 98 // step)
    start = rng.randint(BOUND + 1 - steps * step, BOUND - (steps - 1) * step)
    return Problem(f"{start}+{step}>{BOUND}:", str(start + steps * step), worked_solution(start, step, BOUND))


class Chain(Task):
    name = "chain"
    alphabet = "0123456789+=>:;\\boxed{}"
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
