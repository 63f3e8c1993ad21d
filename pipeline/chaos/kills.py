"""SIGKILL trials: a short run, a role's process killed at random moments while the run works, the run read back.

Worker roles (prompts, rollout, reward, trainer) are restarted by the launcher, at most MAX_RESTARTS times per
worker, so a run takes that many kills of one role. Each kill waits until the pipeline works again after the
last one (the role's new process has logged its start and the trainer has stepped since), then a random delay,
so kills land in every phase of the work: mid-generation, mid-scoring, between a manifest and its step, in a
checkpoint. `launcher` and `broker` kill the launcher or its embedded broker, which ends the run, and then
resume it with `asyncrl run --resume RUN_DIR`, as a user would.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.chaos import procs
from pipeline.chaos.audit import Audit, audit_export, order_problems
from pipeline.chaos.runs import Launch, RunStalled, short_run, summary_of
from workers.announce import load_key

WORKER_ROLES = ("prompts", "rollout", "reward", "trainer")
RESUME_ROLES = ("launcher", "broker")
ORPHAN_GRACE_S = 10.0  # a worker orphaned by its launcher exits within 5 s (workers.runtime.ORPHAN_GRACE_S)


@dataclass(frozen=True)
class Settings:
    out: Path
    steps: int = 60
    max_delay_s: float = 3.0  # after the pipeline works again: the random moment of the next kill
    recover_timeout_s: float = 180.0  # for the pipeline to work again after a kill
    run_timeout_s: float = 600.0
    seed: int = 0
    overrides: tuple[str, ...] = ()

    def run_args(self, index: int) -> list[str]:
        return [*short_run(self.steps, self.seed + index), f"max_wall_s={self.run_timeout_s}", *self.overrides]


@dataclass
class Kill:
    role: str
    pid: int
    at_s: float  # since the launch
    trainer_step: int  # the newest step the trainer had reported


@dataclass
class RunResult:
    index: int
    roles: list[str]  # the roles this run was to kill
    kills: list[Kill] = field(default_factory=list)
    seconds: float = 0.0
    exit_code: int | None = None
    summary: dict = field(default_factory=dict)
    audit: Audit | None = None
    leftover: list[str] = field(default_factory=list)  # command lines of processes left behind
    error: str = ""  # why it did not end normally (stalled, no export)

    @property
    def completed(self) -> bool:
        return self.exit_code == 0 and self.summary.get("outcome") == "finished" and not self.error


def kill_once(launch: Launch, role: str, settings: Settings, rng: random.Random, killed: set[int]) -> Kill | None:
    """Wait until `role` runs again and the trainer has stepped since, then a random delay, then SIGKILL it;
    None when the run ended (or made its last step) first."""
    seen_started: dict[str, float] = {}

    def working() -> bool:
        pid = launch.role_pid(role)
        if pid is None or pid in killed:
            return False
        if role in WORKER_ROLES and not launch.worker_started(role, pid):
            return False
        if role in RESUME_ROLES and not (launch.run_dir and any((launch.run_dir / "checkpoints").glob("step_*"))):
            return False  # a run resumes from its last checkpoint: before the first there is nothing to resume
        since = seen_started.setdefault("t", time.time())
        return any(line["time"] > since for line in launch.trainer_lines())

    if not launch.poll_until(working, settings.recover_timeout_s, f"{role} working again"):
        return None
    time.sleep(rng.uniform(0, settings.max_delay_s))
    pid, step = launch.role_pid(role), launch.last_step()
    if pid is None or step >= settings.steps or not procs.kill(pid):
        return None
    killed.add(pid)
    return Kill(role, pid, round(time.monotonic() - launch.started, 1), step)


def worker_run(settings: Settings, roles: list[str], index: int, rng: random.Random, on_kill) -> RunResult:
    """One run killing `roles` in this order (a role as often as it is named), read back once it ends."""
    result, started = RunResult(index, roles), time.monotonic()
    launch = Launch(settings.out / "runs" / f"{'+'.join(sorted(set(roles)))}-{index}", settings.run_args(index))
    killed: set[int] = set()
    try:
        for role in roles:
            kill = kill_once(launch, role, settings, rng, killed)
            if kill is None:
                break
            result.kills.append(kill)
            on_kill(kill)
        result.exit_code = launch.wait(settings.run_timeout_s)
    except RunStalled as stalled:
        result.error = f"stalled: {stalled}"
    finally:
        launch.end()  # whatever went wrong here, the run does not outlive its trial
    conclude(result, [launch], settings, started)
    return result


def resume_run(settings: Settings, roles: list[str], index: int, rng: random.Random, on_kill) -> RunResult:
    """One run whose launcher or broker (`roles`, in order) is SIGKILLed, and resumed after each kill."""
    result, started = RunResult(index, roles), time.monotonic()
    launches = [Launch(settings.out / "runs" / f"{'+'.join(sorted(set(roles)))}-{index}", settings.run_args(index))]
    try:
        for role in roles:
            kill = kill_once(launches[-1], role, settings, rng, set())
            if kill is None:
                break
            result.kills.append(kill)
            on_kill(kill)
            launches[-1].wait(60)  # a dead broker ends its launcher by itself, within seconds
            result.leftover += [p.cmdline for p in left_behind(launches[-1])]
            launches.append(Launch(launches[-1].runs_dir, [], resume=launches[-1].run_dir))
        result.exit_code = launches[-1].wait(settings.run_timeout_s)
    except RunStalled as stalled:
        result.error = f"stalled: {stalled}"
    finally:
        launches[-1].end()
    conclude(result, launches, settings, started)
    return result


def left_behind(launch: Launch) -> list[procs.Proc]:
    """What is alive of a launch that has ended (after the grace an orphaned worker has); killed once counted."""
    texts = tuple(text for text in (str(launch.run_dir or ""), f"tcp://{launch.bootstrap}") if text)
    found = procs.leftovers(launch.seen, texts, ORPHAN_GRACE_S)
    procs.kill_all(found)
    return found


def conclude(result: RunResult, launches: list[Launch], settings: Settings, started: float) -> None:
    """Leftover processes, the summary and the audit of the run's exported topics."""
    result.leftover += [p.cmdline for p in left_behind(launches[-1])]
    run_dir = launches[-1].run_dir
    result.summary = summary_of(run_dir)
    export = run_dir / "topics.export" if run_dir else None
    if export is not None and export.exists():
        result.audit = audit_export(export, settings.steps, load_key(run_dir))
        result.audit.problems += order_problems(launches[-1].trainer_lines())  # a resumed launch's lines follow
    elif not result.error:
        result.error = "no topics.export: the run cannot be read back"
    result.seconds = round(time.monotonic() - started, 1)
