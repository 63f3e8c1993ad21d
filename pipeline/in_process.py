"""`asyncrl run --in-process`: the whole pipeline in one process, as a map of its dataflow and to debug it.

The roles are the same `main(config, stop, transport)` loops that `asyncrl run` starts as processes, here
tasks of one asyncio loop sharing one in-memory transport (`topics.memory`) in place of the broker. A
breakpoint anywhere (`breakpoint()`, or a debugger's) stops the whole pipeline at that line. What flows
where, read top to bottom in `ROLES`:

    dataset rows -> prompt source -> `prompts` -> rollout -> `segments` -> reward -> `scored` -> trainer
    trainer -> `batches` (what each step trained), `weights` (each new version) -> rollout, prompt source

The run directory is the one `asyncrl run` writes (config.yaml, metrics.jsonl, logs/, weights/,
summary.json). It is not a way to run fast: the roles share one process's cores and its GIL. torch's thread
count is the process's, and the trainer's step (on a thread of its own) may compute while the rollout
decodes, so each gets half of the process's cores. One worker per role; no held-out evaluation (its process
runs at idle priority, which would be this whole process's: `asyncrl eval --run DIR` scores the versions
afterwards), no W&B stream; the topics end with the process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass

from msgspec.structs import replace

from pipeline import monitor
from pipeline.config import ConfigError
from pipeline.export_model import export_final
from pipeline.launch.run_dir import check_dataset, link_latest, new_run_dir, prepare
from schemas.config import RunConfig
from topics.memory import MemoryTransport
from workers import prompt_source, runtime
from workers.cores import cores_here
from workers.reward import worker as reward
from workers.rollout import worker as rollout
from workers.trainer import worker as trainer

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ROLES = {  # each role's loop: what it reads -> what it writes
    "prompts": prompt_source.main,  # dataset rows, `weights` (the version to release at) -> `prompts`
    "rollout": rollout.main,  # `prompts`, `weights` (loaded between decode steps) -> `segments`
    "reward": reward.main,  # `segments` (joined into trajectories) -> `scored`
    "trainer": trainer.main,  # `scored`, `prompts` (staleness deadlines) -> `batches`, `weights`
}


def run_in_process(config: RunConfig, progress: bool = True) -> int:
    """The launcher's checks and preparation, every role run, then summary.json as `asyncrl run` writes it.
    0 once the trainer has made its last step, 128 + N after signal N, else 1; a role's error is raised (its
    traceback in full) once the summary is written."""
    started = time.time()
    check_dataset(config)  # a dataset without one usable row fails here, before anything is built
    config, _ = prepare(new_run_dir(one_process(config)), progress)  # the run directory, demo model, config.yaml
    run_dir = runtime.run_dir(config)
    link_latest(run_dir)  # runs/latest
    monitor.note_start(run_dir)  # metrics.jsonl's first line; every role appends its own after it
    print(f"asyncrl: run directory {run_dir}, every role in this process", file=sys.stderr)
    ending = asyncio.run(run_roles(config))
    summary = monitor.finish(config, run_dir, ending.outcome, started, reason=ending.reason)  # from metrics.jsonl
    summary = export_final(run_dir, summary)  # the last version as a Hugging Face model in final-model/
    print(json.dumps(summary, indent=2))
    if ending.error is not None:
        raise ending.error
    return ending.exit_code


@dataclass
class Ending:
    """How the run ended, as summary.json and the exit code say it."""

    outcome: str = "finished"  # or 'stopped' (a signal), 'failed'
    reason: str | None = None  # None: summary.json's own (the reward worker's verdict, if any)
    exit_code: int = 0
    error: BaseException | None = None  # a role's, raised once the summary is written


async def run_roles(config: RunConfig) -> Ending:
    """Every role's loop on one memory transport until the trainer's last step, Ctrl-C or SIGTERM, the reward
    worker's failure budget spent or a role's error; then every loop stopped and waited for."""
    transport, stop, ending = MemoryTransport(runtime.topic_layout(config)), asyncio.Event(), Ending()
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stopped_by, signal.Signals(signum), stop, ending)
    # at a breakpoint, what a topic holds: `transport.broker.messages("scored", Scored)`
    tasks = {role: asyncio.create_task(main(config, stop, transport), name=role) for role, main in ROLES.items()}
    running = {*tasks.values(), asyncio.create_task(stop.wait())}
    while not (stop.is_set() or tasks["trainer"].done() or tasks["reward"].done()):
        done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        if any(task.exception() for task in done):
            break
    if not (stop.is_set() or tasks["trainer"].done()):  # the reward worker's budget spent, or a role failed
        ending = Ending("failed", exit_code=1)
    stop.set()  # every loop ends at its next turn (the trainer at its step's end)
    for signum in STOP_SIGNALS:  # from now on a second Ctrl-C interrupts the wait below
        loop.remove_signal_handler(signum)
    for role, result in zip(tasks, await asyncio.gather(*tasks.values(), return_exceptions=True), strict=True):
        if isinstance(result, BaseException) and ending.error is None:
            ending = Ending("failed", f"{role}: {type(result).__name__}: {result}", 1, result)
    return ending


def stopped_by(signum: signal.Signals, stop: asyncio.Event, ending: Ending) -> None:
    ending.outcome, ending.reason, ending.exit_code = "stopped", f"{signum.name} received", 128 + signum
    stop.set()


def one_process(config: RunConfig) -> RunConfig:
    """What differs from `asyncrl run`: no broker, one worker per role, half the cores each for the trainer's
    and the rollout's torch threads, no held-out evaluation."""
    if config.rollout.workers > 1 or config.trainer.ranks > 1:
        raise ConfigError(
            f"--in-process runs one worker per role, not rollout.workers={config.rollout.workers} "
            f"and trainer.ranks={config.trainer.ranks}"
        )
    threads = max(1, cores_here() // 2)
    return replace(
        config,
        broker=replace(config.broker, bootstrap=""),
        trainer=replace(config.trainer, threads=threads),
        rollout=replace(config.rollout, threads=threads),
        eval=replace(config.eval, enabled=False),
    )
