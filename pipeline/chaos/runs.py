"""One `asyncrl run` as users start it (a subprocess in a session of its own), watched from outside: its
processes, its trainer's steps, its workers' logs. The harness never reaches into a run any other way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pipeline.chaos import procs

STALL_S = 180.0  # no new trainer step for this long: the run is stuck (a restart costs ~20 s, warm-up ~30 s)
STOP_S = 120.0  # for a stopped launcher to checkpoint, export its topics and write its summary


class RunStalled(RuntimeError):
    """A run that did not get where it was expected to within its time."""


def short_run(steps: int, seed: int) -> list[str]:
    """The arith demo made short, as the e2e tests make it: untrained (sequences run to the length limit, so new
    weights interrupt many), small groups, a checkpoint every 5 steps (a restarted trainer redoes manifests),
    8 held-out rows scored at the start and the end."""
    return [
        f"trainer.steps={steps}",
        "trainer.batch_groups=4",
        "data.n_samples=4",
        "model.warmup_steps=0",
        "rollout.max_new_tokens=16",
        "eval.every=0",
        "eval.max_rows=8",
        "trainer.checkpoint.every=5",
        f"seed={seed}",
    ]


class Launch:
    """`asyncrl run ARGS` (or `asyncrl run --resume RUN_DIR`) writing into `runs_dir`; stdout and stderr to files."""

    def __init__(self, runs_dir: Path, args: list[str], resume: Path | None = None):
        self.runs_dir, self.started = runs_dir, time.monotonic()
        runs_dir.mkdir(parents=True, exist_ok=True)
        tail = ["--resume", str(resume)] if resume else [*args, f"runs_dir={runs_dir}"]
        number = len(list(runs_dir.glob("launch-*.out")))
        self.out_path = runs_dir / f"launch-{number}.out"
        with open(self.out_path, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "run", *tail, "--no-progress"],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.seen: dict[int, procs.Proc] = {}  # every process it started, for the leftover check
        self.progress = (0, time.monotonic())  # the trainer's newest step, and since when

    @property
    def run_dir(self) -> Path | None:
        """The run directory, once its config.yaml is written (`latest` moves only then)."""
        latest = self.runs_dir / "latest"
        return latest.resolve() if latest.exists() else None

    @property
    def bootstrap(self) -> str | None:
        run_dir = self.run_dir
        return yaml.safe_load((run_dir / "config.yaml").read_text())["broker"]["bootstrap"] if run_dir else None

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def processes(self) -> dict[int, procs.Proc]:
        """Its live processes now (broker, workers, theirs), remembered in `seen`."""
        found = procs.descendants(self.process.pid)
        self.seen |= found
        return found

    def role_pid(self, role: str) -> int | None:
        """The top process of a role now: a worker (`asyncrl worker ROLE`), the broker, or the launcher itself."""
        if role == "launcher":
            return self.process.pid if self.process.poll() is None else None
        found = self.processes()
        marker = "tansu" if role == "broker" else f" worker {role} "
        tops = [p for p in found.values() if marker in p.cmdline and found.get(p.ppid) is None]
        return tops[0].pid if tops else None

    def trainer_lines(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl" if self.run_dir else None
        if path is None or not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if '"source": "trainer"' in line and line.endswith("}")]

    def last_step(self) -> int:
        """The newest step the trainer has reported (0 before any)."""
        return max((line["step"] for line in self.trainer_lines()), default=0)

    def worker_started(self, role: str, pid: int) -> bool:
        """The worker `pid` has logged that it started (its Kafka clients are up, its model loaded)."""
        log = self.run_dir / "logs" / f"{role}-{os.uname().nodename}-{pid}.jsonl" if self.run_dir else None
        return log is not None and log.exists() and " started" in log.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        """Its exit code; RunStalled (the run stopped as a user would, so that it still exports its topics) when
        the trainer reports no new step for STALL_S, or the run does not end within `timeout_s`."""
        self.poll_until(lambda: self.process.poll() is not None, timeout_s, "end of the run")
        return self.process.wait()

    def stalled(self) -> bool:
        """No new trainer step for STALL_S (a restart, the warm-up or the final evaluation take far less)."""
        step, now = self.last_step(), time.monotonic()
        if step != self.progress[0]:
            self.progress = (step, now)
        return now - self.progress[1] > STALL_S

    def stop(self) -> None:
        """SIGTERM, as Ctrl-C would stop it (the launcher exports the topics), SIGKILL if that takes too long."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.end()

    def end(self) -> None:
        """SIGKILL to the launcher and everything it started, if it still runs; reaped."""
        if self.process.poll() is None:
            self.processes()
            procs.kill_all([*procs.alive(self.seen), procs.Proc(self.process.pid, 0, "")])
            self.process.wait()

    def poll_until(self, condition, timeout_s: float, what: str) -> bool:
        """Wait for `condition()`; False when the launcher ended first. A stall or `timeout_s` stops the run
        (`stop`) and raises RunStalled."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            self.processes()
            if self.process.poll() is not None:
                return False
            if self.stalled() or time.monotonic() > deadline:
                why = f"no trainer step for {STALL_S:.0f} s" if self.stalled() else f"no {what} in {timeout_s:.0f} s"
                self.stop()
                raise RunStalled(f"{why} (the trainer was at step {self.progress[0]}); stopped with SIGTERM")
            time.sleep(0.2)
        return True


def summary_of(run_dir: Path | None) -> dict:
    path = run_dir / "summary.json" if run_dir else None
    return json.loads(path.read_text()) if path and path.exists() else {}


def resume_available() -> bool:
    """`asyncrl run --resume RUN_DIR` exists in this build (`asyncrl run --help` lists it)."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", "--help"], capture_output=True, text=True, timeout=60
    )
    return "--resume" in done.stdout
