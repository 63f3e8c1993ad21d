"""A run's dataset with bad rows among the good ones: what a JSONL someone else wrote may hold.

Every bad row must reach `dead-letter` with its line number; the good rows keep their order, so a clean run of
the same good rows is the baseline of the poisoned one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from workers.tasks import load_task


def task_rows(seed: int, held_out: int) -> tuple[list[dict], list[dict]]:
    """The arith task's train and held-out rows as the run would split them, as JSON objects."""
    train, test = load_task("arith").split(seed, held_out)
    return [{"prompt": p.prompt, "answer": p.answer} for p in train], [
        {"prompt": p.prompt, "answer": p.answer} for p in test
    ]


def _row(prompt: object = "12+3=", answer: object = "15", **extra: object) -> bytes:
    return json.dumps({"prompt": prompt, "answer": answer, **extra}).encode()


def _nested(rng: random.Random) -> bytes:
    depth = rng.choice([1_500, 20_000, 200_000])
    return b"[" * depth + b"]" * depth


# Each makes one line (no \n inside) that is not a usable row: malformed JSON, missing or mistyped fields,
# invalid UTF-8, lone surrogates, deep nesting, huge integers, text the tokenizer cannot represent.
BAD_ROWS: dict[str, Callable[[random.Random], bytes]] = {
    "truncated JSON": lambda rng: _row()[: rng.randint(1, len(_row()) - 1)],
    "not an object": lambda rng: rng.choice([b"[1, 2]", b"null", b"42", b'"12+3="', b"true"]),
    "missing prompt": lambda rng: b'{"answer": "15"}',
    "missing answer": lambda rng: b'{"prompt": "12+3="}',
    "mistyped field": lambda rng: rng.choice([_row(prompt=12), _row(answer=None), _row(answer=True), _row(prompt="")]),
    "invalid UTF-8": lambda rng: _row().replace(b"12+", b"1" + rng.randbytes(2).replace(b"\n", b"") + b"\xff+"),
    "lone surrogate": lambda rng: rng.choice([b'{"prompt": "1\\ud800+2=", "answer": "3"}', _row(note="\udfff")]),
    "deep nesting": lambda rng: rng.choice([_nested(rng), _row()[:-1] + b', "x": ' + _nested(rng) + b"}"]),
    "huge integer": lambda rng: rng.choice([_row(answer=10**5000), _row(prompt=10**60)]),
    "control character": lambda rng: b'{"prompt": "12\x1c+3=", "answer": "15"}',  # a raw control byte: not JSON
    "outside the tokenizer": lambda rng: rng.choice([_row(prompt="ab+c="), _row(prompt="12\u2028+3=")]),
    "too long": lambda rng: _row(prompt="1+" * 200 + "1="),
}


def _huge_json(make: Callable[[], bytes]) -> bytes:
    """json.dumps refuses to write ints over 4300 digits by default; raise the limit just to write the row."""
    import sys

    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return make()
    finally:
        sys.set_int_max_str_digits(limit)


def bad_row(rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(sorted(BAD_ROWS))
    return kind, _huge_json(lambda: BAD_ROWS[kind](rng))


def write_dataset(path: Path, good: list[dict], bad: int, rng: random.Random) -> dict[int, str]:
    """`good` rows in order with `bad` bad rows at random places; the bad rows' line numbers and kinds."""
    lines: list[tuple[str | None, bytes]] = [(None, json.dumps(row).encode()) for row in good]
    for _ in range(bad):
        lines.insert(rng.randint(0, len(lines)), bad_row(rng))
    path.write_bytes(b"".join(line + b"\n" for _, line in lines))
    return {number: kind for number, (kind, _) in enumerate(lines, start=1) if kind is not None}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
