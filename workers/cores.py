"""The run's cores on one machine, lent between its workers while one of them has no work.

On 2 cores the trainer computes on one and the rollout worker on the other, and the rollout worker waits at
the staleness bound much of the time: its core then idles while the trainer's step is what everyone waits
for. Each core is a lock file under <run dir>/cores (flock): a worker computes with as many torch threads as
it holds cores. A rollout worker holds its own while it generates and leaves them while it has nothing to do;
the trainer borrows whatever is free for one step and gives it back after, and borrows nothing while a rollout
worker waits for its own, so one with work waits at most one step for its core. The trainer and the rollout
workers never compute on one core together (more threads than cores collapse tiny matmuls: 0.13 s became
2.3 s per step here); the reward worker and the broker are not in the ledger, and the run's evaluator needs
not be: it runs under SCHED_IDLE (`lower_priority`). The kernel drops a dead process's locks: a killed
worker never keeps a core.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from schemas.config import RunConfig


def lower_priority() -> None:
    """Every thread of this process, and those it starts later, to SCHED_IDLE: it computes only on a core
    that no other process wants (nice 19 where there is no SCHED_IDLE)."""
    if not hasattr(os, "SCHED_IDLE"):
        os.nice(19)
        return
    set_policy("self", os.SCHED_IDLE)


def restore_priority(pid: int) -> None:
    """Process `pid`'s threads back from SCHED_IDLE to the normal policy where this process may (CAP_SYS_NICE,
    as root, or an RLIMIT_NICE of 20; measured: an unprivileged owner may not): once it alone wants the cores,
    an idle-class process would still wait behind any busy process of anyone's on the machine."""
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(FileNotFoundError, PermissionError):  # it has exited; not ours to raise
            set_policy(str(pid), os.SCHED_OTHER)


def set_policy(process: str, policy: int) -> None:
    for thread in os.listdir(f"/proc/{process}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setscheduler(int(thread), policy, os.sched_param(0))


def cores_here() -> int:
    """The cores this process may run on (its affinity mask, which Slurm and taskset narrow)."""
    return len(os.sched_getaffinity(0))


def split_cores(cores: int, ranks: int, workers: int, trainer: int = 0, rollout: int = 0) -> tuple[int, int]:
    """(threads per trainer rank, threads per rollout worker) on `cores`: the given ones (non-zero) kept, the
    others an equal share each, at least 1, with what is left over to the trainer, whose step is on every
    sample's path."""
    if not rollout:
        rollout = max(1, (cores - trainer * ranks) // workers) if trainer else max(1, cores // (ranks + workers))
    return trainer or max(1, (cores - rollout * workers) // ranks), rollout


class CoreLedger:
    """This process's cores among the run's `cores` (lock files in `directory`)."""

    def __init__(self, directory: Path, cores: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.files = [open(directory / f"core-{i}", "a+b") for i in range(cores)]  # noqa: SIM115 (held for life)
        self.held: set[int] = set()
        self.wanted = directory / f"wanted-{os.getpid()}-{id(self)}"  # while `hold` waits

    def take(self, count: int) -> int:
        """Up to `count` more cores among those no one holds, without waiting; how many were taken."""
        taken = 0
        for i, file in enumerate(self.files):
            if taken == count:
                break
            if i in self.held:
                continue
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            self.held.add(i)
            taken += 1
        return taken

    def hold(self, count: int, stopped: Callable[[], bool] = lambda: False, poll_s: float = 0.002) -> bool:
        """Hold at least `count` cores, waiting for others to give theirs back (the trainer does after a step);
        False if `stopped` first."""
        if len(self.held) >= count:
            return True
        self.wanted.touch()
        try:
            while len(self.held) < count:
                if stopped():
                    return False
                if not self.take(count - len(self.held)):
                    time.sleep(poll_s)
            return True
        finally:
            self.wanted.unlink(missing_ok=True)

    def borrow(self, count: int) -> int:
        """`take`, unless another process waits for its cores (`hold`): they are its own, just given back."""
        return 0 if self.someone_waits() else self.take(count)

    def someone_waits(self) -> bool:
        """Another ledger of the run waits for its cores (a killed waiter's mark is ignored)."""
        return any(
            mark != self.wanted and Path(f"/proc/{mark.name.split('-')[1]}").exists()
            for mark in self.directory.glob("wanted-*")
        )

    def keep(self, count: int) -> None:
        """Give back all but `count` of the held cores."""
        for i in sorted(self.held)[count:]:
            fcntl.flock(self.files[i], fcntl.LOCK_UN)
            self.held.discard(i)

    def close(self) -> None:
        """Give every core back (closing a lock file drops its lock)."""
        for file in self.files:
            file.close()
        self.held.clear()


def ledger_for(config: RunConfig, run_dir: Path) -> CoreLedger | None:
    """The run's ledger on this machine, or None where nothing is lent: not asked for (`trainer.borrow_cores`),
    workers on several machines (`cores` 0), trainer ranks that must stay in step (more than one), or more
    threads than cores to begin with."""
    trainer, rollout = config.trainer, config.rollout
    cores = config.launcher.cores
    if not (trainer.borrow_cores and cores) or trainer.ranks > 1:
        return None
    if trainer.threads + rollout.workers * rollout.threads > cores:
        return None
    return CoreLedger(run_dir / "cores" / socket.gethostname(), cores)
