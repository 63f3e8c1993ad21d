"""`wordmath`, word problems for a pretrained chat model: 1 to 4 steps of everyday arithmetic, in words.

    prompt      "Mia has 12 marbles. She buys 5 more marbles. Then she loses 3 marbles. How many marbles does
                 Mia have now? Give the final answer as a number in \\boxed{}."
    answer      "14"

Each step adds, takes away, doubles, triples or halves, each said in a few ways (and the opening and the
question too), with whole numbers from 2 to 15 at the start and below ~100 throughout. SmolLM2-135M-Instruct
(4-bit, dequantized) often gets even one subtraction wrong ("10 - 6 = 2"), and wider numbers, "3 times that
many" or "shares equally among 4 and keeps one share" took its held-out greedy accuracy down to 0.04, pass@4
0.12 (`asyncrl eval`, 50 problems, k 4, T 0.7; 2 shared cores of an Intel Xeon, 2026-11-28): too few right
samples for RL: hence the plain operations and small numbers. The
steps are mixed, 40 % of the problems one step and the rest two to four, so that a group of samples is seldom
all wrong (no signal), while the longer ones leave room to climb; a chat model's worked answers grow with the
steps, long-tailed.

The verifier takes the last \\boxed{} answer, else the last number written (SmolLM2-135M-Instruct never
boxes unasked, and seldom when asked), and compares it with the reference as a number: "The answer is 14."
and "\\boxed{14}" both score 1.0, "12 + 5 - 3" scores by its last number. The problems are a fixed set (the
seed shuffles the split): the task's held-out split is the same rows on every machine.
"""

from __future__ import annotations

import random
import re

from workers.tasks.base import DemoRecipe, Problem, Task

STEP_WEIGHTS = {1: 0.4, 2: 0.3, 3: 0.18, 4: 0.12}  # problems by number of steps
PROBLEMS = 6000  # distinct problems drawn (the held-out split is cut from them)
GENERATOR_SEED = 20_490  # the problem set's own: fixed, whatever the run's seed
INSTRUCTION = "Give the final answer as a number in \\boxed{}."
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

PEOPLE = [
    ("Mia", "she", "her"), ("Leo", "he", "his"), ("Ava", "she", "her"), ("Sam", "he", "his"),
    ("Zoe", "she", "her"), ("Omar", "he", "his"), ("Lena", "she", "her"), ("Ravi", "he", "his"),
    ("Nora", "she", "her"), ("Ben", "he", "his"), ("Ines", "she", "her"), ("Tom", "he", "his"),
]  # fmt: skip
ITEMS = ["apples", "marbles", "stickers", "cookies", "pencils", "coins", "books", "stamps", "shells", "cards"]
OPENINGS = ["{name} has {n} {items}.", "{name} starts with {n} {items}.", "At first, {name} has {n} {items}."]
ADD = [
    "{She} buys {k} more {items}.",
    "A friend gives {her} {k} more {items}.",
    "{She} finds {k} more {items}.",
    "Then {she} gets {k} more.",
]
TAKE = [
    "{She} gives {k} {items} to a friend.",
    "Then {she} loses {k} {items}.",
    "{She} sells {k} of them.",
    "{She} uses {k} {items}.",
]
DOUBLE = ["Then {she} doubles the number of {items}.", "{Her} {items} double."]
TRIPLE = ["Then {she} triples the number of {items}.", "{Her} {items} triple."]
HALVE = ["{She} gives half of {her} {items} to a friend.", "Then {she} loses half of them."]
QUESTIONS = [
    "How many {items} does {name} have now?",
    "How many {items} does {name} end up with?",
    "How many {items} does {name} have at the end?",
]


def next_step(rng: random.Random, total: int) -> tuple[list[str], int]:
    """(phrasings, new total) of one step that keeps the total a whole number from 1 to ~100."""
    choices = ["add", "take"] if total > 1 else ["add"]
    if total <= 12:
        choices.append("times")
    if total % 2 == 0:
        choices.append("halve")
    kind = rng.choice(choices)
    if kind == "add":
        k = rng.randint(1, 10)
        return [t.replace("{k}", str(k)) for t in ADD], total + k
    if kind == "take":
        k = rng.randint(1, total - 1)
        return [t.replace("{k}", str(k)) for t in TAKE], total - k
    if kind == "times":
        return (DOUBLE, total * 2) if rng.random() < 0.6 else (TRIPLE, total * 3)
    return HALVE, total // 2


def word_problem(rng: random.Random) -> Problem:
    name, she, her = rng.choice(PEOPLE)
    items = rng.choice(ITEMS)
    total = rng.randint(2, 15)
    sentences = [rng.choice(OPENINGS).replace("{n}", str(total))]
    steps = rng.choices(list(STEP_WEIGHTS), weights=list(STEP_WEIGHTS.values()))[0]
    for _ in range(steps):
        phrasings, total = next_step(rng, total)
        sentences.append(rng.choice(phrasings))
    sentences += [rng.choice(QUESTIONS), INSTRUCTION]
    words = {"{name}": name, "{items}": items, "{she}": she, "{She}": she.capitalize(), "{her}": her}
    words["{Her}"] = her.capitalize()
    text = " ".join(sentences)
    for key, value in words.items():
        text = text.replace(key, value)
    return Problem(text, str(total), f"\\boxed{{{total}}}", {"steps": str(steps)})


def final_number(completion: str) -> float | None:
    """The completion's answer: the last \\boxed{} one, else the last number written; None if there is none."""
    boxed = BOXED.findall(completion)
    found = NUMBER.findall(boxed[-1]) if boxed else NUMBER.findall(completion)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:  # "1,,2": no number after all
        return None


def characters() -> str:
    """Every character a problem or its worked answer can hold (the demo tokenizer's vocabulary): the words, the
    capitals of "She" and "He", the digits; a placeholder's name adds a few letters of no harm."""
    words = [
        *(w for person in PEOPLE for w in person),
        *ITEMS,
        *OPENINGS,
        *ADD,
        *TAKE,
        *DOUBLE,
        *TRIPLE,
        *HALVE,
        *QUESTIONS,
    ]
    return "".join(sorted(set("".join(words) + INSTRUCTION + "SH0123456789")))


class WordMath(Task):
    """Meant for a pretrained model (`model.path`); the character-level demo model runs it too, and learns
    little more than to box a number."""

    name = "wordmath"
    alphabet = characters()
    max_new_tokens = 256
    demo = DemoRecipe(positions=640)  # the longest prompt (371 characters) and a full completion

    def problems(self, seed: int) -> list[Problem]:
        """PROBLEMS distinct word problems, the same set for every seed (the seed shuffles the split)."""
        rng = random.Random(GENERATOR_SEED)
        found: dict[str, Problem] = {}
        while len(found) < PROBLEMS:
            problem = word_problem(rng)
            found.setdefault(problem.prompt, problem)
        return list(found.values())

    def score(self, completion: str, answer: str) -> float:
        value = final_number(completion)
        return 1.0 if value is not None and value == float(answer) else 0.0

    def final_answer(self, completion: str) -> str:
        value = final_number(completion)
        return "" if value is None else format(value, "g")
