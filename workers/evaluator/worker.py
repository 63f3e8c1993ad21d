"""The run's held-out evaluation as a process of its own, on the cores no one else wants.

The monitor asks for a weight version by hard-linking its file into `<run dir>/eval/queue` (the
trainer deletes all but its newest versions; the link keeps this one until it is scored), and
never waits for the answer. This process (`asyncrl worker eval`, started by the launcher) scores
the queue oldest first with `workers.evaluator.scoring`: the version's `eval` line in metrics.jsonl, its
rows in `eval/v<version>.jsonl`. It runs under SCHED_IDLE, so the kernel gives it a core only when
no other process wants one: an evaluation takes (almost) nothing from the trainer and the rollout
workers (docs: Decisions, the evaluator in the launcher); it falls behind instead and catches up when they wait, or once they
have stopped (the launcher asks for the final version, then waits for the queue to empty; the
evaluator then takes the normal policy back where it may: idle-class, it would wait behind any busy
process on the machine). The reward is called as the reward worker calls it (scoring processes,
`reward.timeout_s` a call, its failure budget: `scoring.RewardCalls`). A version that cannot be
scored, or whose evaluation was given up, gets an `eval_failed` line with the reason instead: it
costs a point of the curve, never the run. Its main thread scores: math-verify times itself with
SIGALRM, which only the main thread may use (reward.processes=0).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from pathlib import Path

from schemas.config import RunConfig
from workers import runtime
from workers.cores import lower_priority, restore_priority

BASE = "v000000.base"  # a request for the model as loaded (version 0): there is no file to link
DONE = "done"  # the launcher's last request is in: exit once the queue is empty
POLL_S = 0.2  # how often an idle evaluator looks at its queue
VERSION_WRITE_WAIT_S = 30.0  # for the file of a step the trainer has reported: it writes versions off the step's path


def queue_dir(run_dir: Path) -> Path:
    return run_dir / "eval" / "queue"


def queued(queue: Path) -> list[Path]:
    """The versions waiting to be scored, oldest first (the base model's before any)."""
    return sorted([*queue.glob(BASE), *queue.glob("v*.safetensors")])


def version_of(request: Path) -> int:
    return int(request.name[1:7])


def link(source: Path, target: Path) -> None:
    """`target` names `source`'s content from now on: a hard link, or a copy (renamed into place) where the
    weights are on another file system. FileNotFoundError when `source` is not there."""
    try:
        os.link(source, target)
    except FileExistsError:  # asked for twice
        pass
    except FileNotFoundError:  # not written yet, or deleted
        raise
    except OSError:  # EXDEV (the weights on shared storage), or a file system without hard links
        partial = target.with_name(target.name + ".partial")
        shutil.copyfile(source, partial)
        partial.replace(target)


def write_whole(weights_dir: Path, version: int, target: Path) -> None:
    """A delta version's whole file at `target`, rebuilt from its chain and checked against its whole hash (the
    queue then holds it while its chain may be collected)."""
    from workers.weight_deltas import read_stored_version  # torch: only where delta versions are asked for

    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(read_stored_version(weights_dir, version).data)
    partial.replace(target)


class EvalRequests:
    """The monitor's side of the queue: a version asked for is linked in once the trainer has written its file,
    without waiting for it; given up when a newer file shows it was deleted, or when it is not written in time."""

    def __init__(self, run_dir: Path, weights_dir: Path, resumed_from: int | None = None):
        self.queue, self.weights_dir = queue_dir(run_dir), weights_dir
        self.queue.mkdir(parents=True, exist_ok=True)
        (self.queue / DONE).unlink(missing_ok=True)  # a resumed run's: its first launch's evaluator had finished
        for request in queued(self.queue) if resumed_from is not None else ():
            if version_of(request) > resumed_from:  # weights of steps the resumed run trains anew
                request.unlink()
        self.waiting: dict[int, float] = {}  # version -> when to give up on its file

    def ask(self, version: int, wait_s: float = VERSION_WRITE_WAIT_S) -> None:
        """Version `version` to be scored (0: the model as loaded)."""
        if version == 0:
            (self.queue / BASE).touch()
            return
        self.waiting[version] = time.monotonic() + wait_s
        self.link_written()

    def link_written(self) -> list[int]:
        """Link every version asked for whose file is there; the versions given up on."""
        dropped = []
        for version, deadline in sorted(self.waiting.items()):
            source = runtime.version_path(self.weights_dir, version)
            try:
                if not source.is_file() and runtime.delta_path(self.weights_dir, version).is_file():
                    write_whole(self.weights_dir, version, self.queue / source.name)
                else:
                    link(source, self.queue / source.name)
            except ValueError as error:  # a delta chain that does not rebuild (WeightsError)
                print(f"asyncrl eval: version {version} not queued: {error}", flush=True)
                dropped.append(version)
            except FileNotFoundError:
                newer = any(other.name > source.name for other in self.weights_dir.glob("v*.safetensors"))
                if not (newer or time.monotonic() > deadline):
                    continue  # on its way
                dropped.append(version)
            del self.waiting[version]
        return dropped

    def close(self) -> None:
        """No more requests (the trainer has stopped: a version not written now never will be); the evaluator
        exits once it has scored the queue."""
        self.link_written()
        self.waiting.clear()
        (self.queue / DONE).touch()

    def pending(self) -> int:
        return len(queued(self.queue)) + len(self.waiting)


def note_failed(run_dir: Path, version: int, reason: str, reward_failures: dict[str, int] | None = None) -> None:
    """An `eval_failed` line in metrics.jsonl: version `version` has no accuracy, and why (summary.json lists
    them, and counts the reward's failures by kind)."""
    line = {"step": version, "version": version, "reason": reason, "reward_failures": reward_failures or {}}
    runtime.MetricsWriter(run_dir / "metrics.jsonl", "eval_failed").write(**line)


async def score_version(run_dir: Path, evaluator, version: int, weights: Path | None) -> dict | None:
    """Score `weights` (a version's file; None: the model as loaded) as version `version`: its rows to
    eval/v<version>.jsonl, its `eval` line appended to metrics.jsonl (`eval_failed` when the evaluation was given
    up). The line, or None when the file is gone."""
    from workers.evaluator.scoring import EVAL_KEYS, write_rows

    started = time.monotonic()
    result = await evaluator.evaluate(weights)
    if result is None:
        return None
    summary = result.summary
    write_rows(run_dir / "eval" / f"v{version:06d}.jsonl", result.rows)
    if summary["failed"]:
        note_failed(run_dir, version, summary["failed"], summary["reward_failures"])
        return None
    line = {"step": version, "version": version, "heldout_accuracy": summary["greedy_accuracy"]}
    line["seconds"] = round(time.monotonic() - started, 1)  # the launcher keeps the longest for the final one
    line |= {key: summary[key] for key in EVAL_KEYS if summary[key] is not None}
    line |= {"reward_calls": summary["reward_calls"], "reward_failures": summary["reward_failures"]}
    runtime.MetricsWriter(run_dir / "metrics.jsonl", "eval").write(**line)
    return line


async def main(config: RunConfig, stop: asyncio.Event) -> None:
    """Score the queue until the launcher is done asking (`DONE`) and it is empty, or until stopped."""
    from workers.evaluator.scoring import Evaluator

    lower_priority()  # the launcher starts it so; by hand, from here on
    run_dir, queue = runtime.run_dir(config), queue_dir(runtime.run_dir(config))
    evaluator = Evaluator.for_config(config)
    try:
        while not stop.is_set():
            done = (queue / DONE).exists()  # before the queue is read: every request was in before it
            if done:  # the workers have stopped: the cores are its own now
                restore_priority(os.getpid())
            pending = queued(queue)
            if pending:
                request, version = pending[0], version_of(pending[0])
                try:
                    await score_version(run_dir, evaluator, version, None if request.name == BASE else request)
                except Exception as exc:  # e.g. a file that is not this model's weights
                    print(f"asyncrl eval: version {version} not scored: {type(exc).__name__}: {exc}", flush=True)
                    note_failed(run_dir, version, f"not scored: {type(exc).__name__}: {exc}")
                request.unlink()
            elif done:
                return
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), POLL_S)
    finally:
        evaluator.score.close()
