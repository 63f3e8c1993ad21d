"""A random source for the warm-up teachers' tests: `random()` always returns one value, so a teacher always
(0.0) or never (1.0) makes its mistake."""

from __future__ import annotations

import random


class Draws(random.Random):
    def __init__(self, value: float):
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value
