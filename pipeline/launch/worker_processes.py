"""The launcher's worker processes: each forked from the run's fork server (`pipeline.forkserver`) or started as
`asyncrl worker ROLE`, stopped with SIGTERM and, past a timeout, SIGKILL."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.forkserver import ForkedProcess, ForkServer
from pipeline.launch.stop_signals import StopSignals
from pipeline.roles import worker_argv
from topics.broker import die_with_parent
from workers.cores import lower_priority


@dataclass
class WorkerProcess:
    role: str
    index: int
    config_path: Path
    log_path: Path
    ranks: int = 1  # > 1: that many processes under torchrun (the trainer's FSDP2 ranks)
    idle: bool = False  # under SCHED_IDLE from its first instruction (the evaluator)
    forks: ForkServer | None = None  # where it is forked from, already imported (`pipeline.forkserver`)
    process: subprocess.Popen | ForkedProcess | None = None
    restarts: int = 0

    def start(self) -> None:
        """Forked by the run's fork server where it has one (a trainer of several ranks never is), else started
        as `asyncrl worker ROLE` (compose and Slurm start it so too)."""
        with StopSignals.held():  # a stop while it starts is raised once it is recorded
            if self.forks is not None and self.ranks == 1:
                self.process = self.forks.fork(self.role, self.config_path, self.log_path, self.idle, StopSignals.due)
                if self.process is not None or StopSignals.due():  # none started for a run that stops
                    return
            worker = worker_argv(self.role, self.config_path)[1:]  # after the interpreter
            if self.ranks > 1:  # torchrun forwards SIGTERM to its ranks and ends them all when one fails
                worker = ["-m", "pipeline.local_torchrun", f"--nproc-per-node={self.ranks}", *worker]  # on loopback
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, *worker],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=self.before_exec,
                )

    def before_exec(self) -> None:
        """In the child: it dies with the launcher, and an idle worker computes on idle cores only."""
        die_with_parent()
        if self.idle:
            lower_priority()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it does not end in time; always reaped."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def stop_at_once(workers: list[WorkerProcess], timeout_s: float) -> None:
    """SIGTERM to every worker together, SIGKILL to those still there `timeout_s` later."""
    running = [w.process for w in workers if w.process is not None and w.process.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in running:
        try:
            process.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
