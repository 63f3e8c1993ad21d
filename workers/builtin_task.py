"""The built-in demo task "ab+c=": a two-digit number plus a one-digit number.

Small enough that a ~2M-parameter model learns it on two CPU cores in minutes, yet
a warmed-up model still gets most held-out problems wrong, so RL has room to climb.
Everything here is pure and deterministic from a seed.
"""

from __future__ import annotations

import random

# The end-of-sequence token as it appears in decoded text; the demo tokenizer uses it.
EOS_TEXT = "<eos>"


def all_problems() -> list[dict[str, str]]:
    """All 90 * 10 = 900 problems, in a fixed order."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 100) for b in range(10)]


def split_rows(seed: int = 0, n_heldout: int = 200) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, held-out): a seeded shuffle of all problems, cut into disjoint sets."""
    rows = all_problems()
    random.Random(seed).shuffle(rows)
    return rows[n_heldout:], rows[:n_heldout]


def score(completion_text: str, answer: str) -> float:
    """1.0 when the completion up to the first end-of-sequence token is exactly the answer."""
    text = completion_text.split(EOS_TEXT, 1)[0].strip()
    return 1.0 if text == answer.strip() else 0.0
