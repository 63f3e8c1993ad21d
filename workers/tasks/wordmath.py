"""`wordmath`, word problems for a pretrained chat model: 1 to 4 steps of everyday arithmetic, in words.

    prompt      "Mia has 12 marbles. She buys 5 more. Then she gives 3 to a friend. How many marbles does Mia
                 have now? Give the final answer as a number in \\boxed{}."
    answer      "14"

Each step adds, takes away, multiplies or shares equally, each said in several ways (and the opening and
the question too), with small whole numbers throughout so that a 135M-parameter model's arithmetic is
rarely the whole difficulty: reading which operation the words mean is. The steps are mixed, a third of
the problems one step and the rest two to four, so that a group of samples is seldom all wrong (no signal)
on a model that gets ~20 % of two-step problems right, while the longer ones leave room to climb; the
worked answers of a chat model grow with the steps, long-tailed.

The verifier takes the last \\boxed{} answer, else the last number written (SmolLM2-135M-Instruct never
boxes unasked, and seldom when asked), and compares it with the reference as a number: "The answer is 14."
and "\\boxed{14}" both score 1.0, "12 + 5 - 3" scores by its last number. The problems are a fixed set (the
seed shuffles the split): the task's held-out split is the same rows on every machine.
"""

from __future__ import annotations

import random
import re

from workers.tasks.base import DemoRecipe, Problem, Task

STEP_WEIGHTS = {1: 0.34, 2: 0.33, 3: 0.18, 4: 0.15}  # problems by number of steps
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
OPENINGS = [
    "{name} has {n} {items}.",
    "{name} starts with {n} {items}.",
    "At first, {name} owns {n} {items}.",
    "There are {n} {items} in {name}'s bag.",
    "{name} collected {n} {items}.",
]
ADD = [
    "{She} buys {k} more.",
    "Then a friend gives {her} {k} more {items}.",
    "{She} finds {k} more {items}.",
    "Later {she} gets another {k}.",
    "{Her} aunt adds {k} {items} to the pile.",
]
TAKE = [
    "{She} gives {k} {items} to a friend.",
    "Then {she} loses {k} of them.",
    "{She} uses {k} {items}.",
    "Later {she} sells {k}.",
    "{k} of the {items} get lost.",
]
TIMES = [
    "Then the number of {items} becomes {k} times as large.",
    "{She} ends up with {k} times as many {items} as before.",
    "A week later {she} has {k} times that many.",
]
SHARE = [
    "{She} shares the {items} equally among {k} friends and keeps one share.",
    "{She} splits them into {k} equal groups and keeps one group.",
    "Then {she} puts them into {k} equal boxes and keeps only one box.",
]
QUESTIONS = [
    "How many {items} does {name} have now?",
    "How many {items} does {name} end up with?",
    "How many {items} are left?",
    "What is the number of {items} {name} has at the end?",
]


def next_step(rng: random.Random, total: int) -> tuple[list[str], int]:
    """(phrasings, new total) of one step that keeps the total a whole number from 1 to ~200."""
    choices = ["add", "take"] if total > 1 else ["add"]
    if total <= 25:
        choices.append("times")
    divisors = [k for k in range(2, 6) if total % k == 0]
    if divisors:
        choices.append("share")
    kind = rng.choice(choices)
    if kind == "add":
        k = rng.randint(2, 20)
        return [t.replace("{k}", str(k)) for t in ADD], total + k
    if kind == "take":
        k = rng.randint(1, total - 1)
        return [t.replace("{k}", str(k)) for t in TAKE], total - k
    if kind == "times":
        k = rng.randint(2, 4)
        return [t.replace("{k}", str(k)) for t in TIMES], total * k
    k = rng.choice(divisors)
    return [t.replace("{k}", str(k)) for t in SHARE], total // k


def word_problem(rng: random.Random) -> Problem:
    name, she, her = rng.choice(PEOPLE)
    items = rng.choice(ITEMS)
    total = rng.randint(2, 30)
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
    words = [*(w for person in PEOPLE for w in person), *ITEMS, *OPENINGS, *ADD, *TAKE, *TIMES, *SHARE, *QUESTIONS]
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
