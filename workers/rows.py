"""A dataset's rows: a task's own problems, or a JSONL or Parquet file's lines (prompt, answer, metadata).

Free of torch and transformers: the launcher checks a run's rows before anything starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from schemas.config import RunConfig
from workers.tasks import Problem, load_task


@dataclass(frozen=True)
class Row:
    index: int  # position in the dataset (for a file: 0-based among valid lines)
    prompt: str
    answer: str
    metadata: dict[str, str]
    line: int = 0  # 1-based line of its file (a task's rows: position + 1), for dead-letters


class BadRow(ValueError):
    def __init__(self, line: int, text: str, reason: str):
        super().__init__(f"line {line}: {reason}")
        self.line, self.text = line, text


def load_rows(config: RunConfig) -> tuple[list[Row], list[BadRow]]:
    """The training rows and the rows that could not be used (with their line numbers)."""
    if config.data.source == "builtin":
        train, _ = load_task(config.data.task).split(config.seed, config.data.held_out)
        return rows_of(train), []
    return read_rows(config.data.source)


def rows_of(problems: list[Problem]) -> list[Row]:
    """A task's problems as dataset rows, indexed in their order."""
    return [Row(i, p.prompt, p.answer, dict(p.metadata), line=i + 1) for i, p in enumerate(problems)]


def read_rows(path: str | Path) -> tuple[list[Row], list[BadRow]]:
    """Rows of a JSONL or Parquet file (prompt, answer, other fields as metadata) and the unusable ones."""
    path = Path(path)
    if path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        lines = [json.dumps(record, default=str).encode() for record in pq.read_table(path).to_pylist()]
    else:  # bytes split at \n only: one bad byte is one bad row, and U+2028 in a string does not end its line
        lines = [line.removesuffix(b"\r") for line in path.read_bytes().split(b"\n")]
    rows, bad = [], []
    for number, data in enumerate(lines, start=1):
        line = data.decode(errors="surrogateescape")  # undecodable bytes kept, to dead-letter them as they were
        if not line.strip():
            continue
        try:
            rows.append(replace(parse_row(len(rows), utf8(data)), line=number))
        except ValueError as exc:
            bad.append(BadRow(number, line, str(exc)))
    return rows, bad


def utf8(data: bytes) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None


def parse_row(index: int, line: str) -> Row:
    """One JSONL row: {"prompt": str, "answer": str|number, ...other fields kept as metadata}."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    except RecursionError:
        raise ValueError("nested too deeply to read") from None
    if not isinstance(data, dict):
        raise ValueError("a row must be a JSON object")
    prompt, answer = data.pop("prompt", None), data.pop("answer", None)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("field 'prompt' must be a non-empty string")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise ValueError("field 'answer' must be a string or a number")
    try:
        metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in data.items()}
        for text in (prompt, str(answer), *metadata, *metadata.values()):
            text.encode()  # a lone surrogate ("\\ud800" in the JSON) is no text: the tokenizer and msgspec refuse it
    except RecursionError:  # json.dumps of a deeply nested field
        raise ValueError("a field is nested too deeply to keep") from None
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds a lone surrogate {exc.object[exc.start : exc.end]!a}: not Unicode text") from None
    return Row(index, prompt, str(answer), metadata)
