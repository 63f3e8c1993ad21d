"""What a task is: seeded train / held-out problems, a verifier, and how to warm up and sample for it.

A task is one class (AReaL-lite style: one file). Subclass `Task`, set the class
attributes, implement `problems` and `score`; run it with `data.task=path/to/file.py:Name`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

EOS_TEXT = "<eos>"  # the demo tokenizer's end-of-sequence token, as it appears in decoded text


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: str = ""  # a worked completion (no end token): what the demo model's warm-up imitates
    metadata: dict[str, str] = field(default_factory=dict)  # handed to the reward function beside "answer"


@dataclass(frozen=True)
class DemoRecipe:
    """The locally built demo model for a task, and the supervised warm-up that makes RL's starting point."""

    hidden_size: int = 192
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    positions: int = 128  # longest prompt + completion the model can hold
    warmup_rows: int = 300  # training problems warm-up learns from (the next `probe_rows` are its probe)
    probe_rows: int = 200
    warmup_batch: int = 64
    warmup_lr: float = 1e-3
    warmup_target: float = 0.16  # warm-up stops when greedy accuracy on the probe reaches this
    warmup_max_steps: int = 150  # ... or after this many steps (model.warmup_steps overrides it)
    probe_every: int = 2  # steps between probes
    length_buckets: int = 1  # > 1: batches regrouped by length among this many (less padding on long tails)


class Task:
    """A plug-in task: implement `problems` (deterministic, distinct prompts) or `split` itself, and `score`."""

    name: ClassVar[str] = ""
    alphabet: ClassVar[str] = ""  # every character of prompts and solutions: the demo tokenizer's vocabulary
    max_new_tokens: ClassVar[int] = 16  # rollout.max_new_tokens when the config leaves it at 0
    demo: ClassVar[DemoRecipe] = DemoRecipe()

    def problems(self, seed: int) -> list[Problem]:
        """Every problem of the task, in a fixed order: `split` shuffles and cuts them."""
        raise NotImplementedError

    def score(self, completion: str, answer: str) -> float:
        """The verifier: 1.0 for a right completion, else 0.0 (or partial credit)."""
        raise NotImplementedError

    def final_answer(self, completion: str) -> str:
        """The completion's answer as a comparable string (majority voting); the whole text by default."""
        return completion.split(EOS_TEXT, 1)[0].strip()

    def demonstrations(self, rows: list[Problem], seed: int) -> list[Problem]:
        """The worked solutions the demo model is warmed up on: the rows' own unless the task's teacher errs."""
        return rows

    def split(self, seed: int, held_out: int) -> tuple[list[Problem], list[Problem]]:
        """(train, held-out): a seeded shuffle of `problems(seed)`, cut into disjoint sets."""
        problems = list(self.problems(seed))
        if held_out >= len(problems):
            raise ValueError(f"task {self.name}: held_out={held_out} leaves no training problem of {len(problems)}")
        random.Random(seed).shuffle(problems)
        return problems[held_out:], problems[:held_out]
