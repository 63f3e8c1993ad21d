"""`asyncrl run --resume`: what a run directory resumes from, its topics brought back into a new embedded broker,
and the lock that keeps a second launcher (or the workers of a killed one) out of a running run's directory."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import ConfigError, load_config
from pipeline.procfs import processes
from schemas.config import RunConfig
from workers import runtime

if TYPE_CHECKING:
    from collections.abc import Iterator


LOCK_FILE = "launcher.lock"  # in the run directory: held by the launcher running it (`run_dir_lock`)
EARLIER_LAUNCH_WAIT_S = 60.0  # for the workers of a killed launcher of the run to end (`wait_for_earlier_launch`)


def import_run_topics(config: RunConfig) -> None:
    """A resumed run's export into its new embedded broker: every record at its offset, the groups' commits."""
    from topics.export import ExportError, import_topics

    path = runtime.topics_export_path(config)
    try:
        counts = asyncio.run(import_topics(path, config.broker.bootstrap, config.broker.topic_prefix))
    except ExportError as exc:
        raise ConfigError(f"cannot resume from {path}: {exc}") from None
    print(f"asyncrl: {sum(counts.values())} records of {path} loaded into the new broker", file=sys.stderr)


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's newest trainer checkpoint (where its trainer resumes), None before the first."""
    from workers.trainer.checkpoint import newest

    checkpoint = newest(run_dir / "checkpoints")
    return None if checkpoint is None else int(checkpoint.stem.removeprefix("step_"))


def resumable(run_dir: Path) -> tuple[RunConfig, int]:
    """The run's own config and the step of its newest checkpoint; a ConfigError (one line) when there is
    nothing to resume from."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: not a run directory, or one stopped before it started")
    config = load_config(run_dir / "config.yaml")
    if runtime.run_dir(config).resolve() != run_dir.resolve():
        raise ConfigError(f"{run_dir} is not where its config.yaml puts the run ({runtime.run_dir(config)})")
    step = checkpoint_step(run_dir)
    if step is None:
        raise ConfigError(f"{run_dir} has no trainer checkpoint to resume from; start the run again")
    if config.launcher.embedded_broker and not runtime.topics_export_path(config).is_file():
        raise ConfigError(f"{run_dir} has no topics.export: the topics of its embedded broker are lost")
    return config, step


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Held while a launcher runs the run in `run_dir` (an flock, let go by the kernel however the launcher
    ends): a second launcher there, e.g. `--resume` of a run still running, is a one-line error, not a
    second run writing the same directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK_FILE, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            raise ConfigError(
                f"{run_dir} is being run by another launcher (pid {holder}): stop it first (Ctrl-C or SIGTERM)"
            ) from None
        except OSError as exc:  # a file system without flock (some NFS and Lustre mounts)
            print(
                f"asyncrl: {run_dir} cannot be locked ({exc.strerror}): a second launcher would not be refused",
                file=sys.stderr,
            )
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        wait_for_earlier_launch(run_dir)
        yield


def wait_for_earlier_launch(run_dir: Path, timeout_s: float = EARLIER_LAUNCH_WAIT_S) -> None:
    """A killed launcher's workers end on their own (SIGTERM at its death; the trainer checkpoints first): wait
    until none is left, so that nothing of the earlier launch writes the directory while this one runs."""
    deadline = time.monotonic() + timeout_s
    if left := workers_of(run_dir):
        print(
            f"asyncrl: waiting for the run's earlier launch to end (pids {', '.join(map(str, left))})", file=sys.stderr
        )
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = workers_of(run_dir)
    if left:
        raise ConfigError(
            f"{run_dir}: processes of its earlier launch still run after {timeout_s:.0f} s (pids "
            f"{', '.join(map(str, left))}): stop them first"
        )


def workers_of(run_dir: Path) -> list[int]:
    """Live processes that run with `run_dir`'s config.yaml (every worker names it on its command line)."""
    config = f" {run_dir / 'config.yaml'} "  # a whole argument: not another file beside it
    return [proc.pid for proc in processes().values() if config in f" {proc.cmdline} "]
