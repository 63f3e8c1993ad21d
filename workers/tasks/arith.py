"""`arith`, the demo task "ab+c=": a two-digit number plus a one-digit number, answered in 2-3 tokens.

Small enough that a ~2M-parameter model learns it on two CPU cores in minutes, yet a
warmed-up model still gets most held-out problems wrong, so RL has room to climb.
"""

from __future__ import annotations

from workers.tasks.base import EOS_TEXT, Problem, Task


class Arith(Task):
    name = "arith"
    alphabet = "0123456789+="
    max_new_tokens = 16

    def problems(self, seed: int) -> list[Problem]:
        """All 90 * 10 = 900 problems, in a fixed order (the seed shuffles them in `split`)."""
        return [Problem(f"{a}+{b}=", str(a + b), str(a + b)) for a in range(10, 100) for b in range(10)]

    def score(self, completion: str, answer: str) -> float:
        """1.0 when the completion up to the first end-of-sequence token is exactly the answer."""
        return 1.0 if completion.split(EOS_TEXT, 1)[0].strip() == answer.strip() else 0.0
