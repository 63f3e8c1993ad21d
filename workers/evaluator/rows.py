"""A run's evaluation set: data.eval_source (a file, the task's held-out split or HumanEval). Free of torch: the
launcher reads it before anything starts (a missing file is a config error then, not a failed evaluator later)."""

from __future__ import annotations

import sys

from schemas.config import RunConfig
from schemas.errors import ConfigError
from workers.evaluator import humaneval
from workers.rows import Row, read_rows, rows_of
from workers.tasks import load_task


def task_rows(spec: str, seed: int, held_out: int) -> list[Row]:
    """The held-out split of a task, as the run that trained on the rest of it split it."""
    return rows_of(load_task(spec).split(seed, held_out)[1])


def file_rows(path: str, what: str) -> list[Row]:
    """Usable rows of a file, ConfigError when there are none; bad rows are named on stderr and skipped."""
    try:
        rows, bad = read_rows(path)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # pyarrow: not a Parquet file, a broken one
        raise ConfigError(f"{what} {path}: {type(exc).__name__}: {exc}") from None
    if bad:
        print(f"asyncrl: {what} {path}: {len(bad)} bad rows skipped ({bad[0]}, ...)", file=sys.stderr)
    if not rows:
        raise ConfigError(f"{what} {path} has no usable row")
    return rows


def rows_for_config(config: RunConfig) -> list[Row] | None:
    """A run's evaluation set: the file data.eval_source names, the task's held-out split ('builtin'), HumanEval
    ('humaneval', written for the run's template), or None ('none')."""
    source = config.data.eval_source_or_default()
    if source == "none":
        return None
    if source == "builtin":
        rows = task_rows(config.data.task, config.seed, config.data.held_out)
    elif source == humaneval.SOURCE:
        rows = humaneval.humaneval_rows(config.data.template)
    else:
        rows = file_rows(source, "data.eval_source")
    return rows[: config.eval.max_rows] if config.eval.max_rows else rows


NO_EVAL_SET = (
    "asyncrl: no evaluation set (data.eval_source is none): base and final accuracy "
    "stay null; add data.eval_source=held_out.jsonl (prompt/answer rows, JSONL or Parquet) to measure them"
)
