"""`asyncrl run`: one machine, one broker, one process per worker, one run directory.

The launcher prepares the model (the demo builds and warms up its own), starts the
embedded broker unless a bootstrap is configured, starts the workers as separate
processes (`asyncrl worker <role>`), follows `metrics.jsonl` for the progress bar
and the held-out evaluation, and stops everything when the trainer has made its
last step, on Ctrl-C, or after `max_wall_s`.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pipeline.config import save_config
from schemas.config import RunConfig
from workers import runtime

WORKER_MODULES = {
    "prompts": "workers.prompt_source",
    "rollout": "workers.rollout.worker",
    "reward": "workers.reward.worker",
    "trainer": "workers.trainer.worker",
}
STOP_ORDER = ("prompts", "rollout", "reward", "trainer")  # the trainer last: it checkpoints on stop
MAX_RESTARTS = 3
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are processes already


def run_worker(role: str, config: RunConfig) -> None:
    """The body of `asyncrl worker <role>`: run until done or SIGTERM."""
    module = importlib.import_module(WORKER_MODULES[role])
    runtime.run_until_stopped(lambda stop: module.main(config, stop))


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, so nothing is orphaned."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class WorkerProcess:
    role: str
    index: int
    config_path: Path
    log_path: Path
    process: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "worker", self.role, "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            )

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


def prepare_run(config: RunConfig) -> tuple[RunConfig, Path]:
    """A fresh run directory `<runs_dir>/<name>-<time>` linked as `<runs_dir>/latest`."""
    runs = Path(config.runs_dir).resolve()
    name = f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    while (runs / name).exists():
        name += "x"
    run_dir = runs / name
    (run_dir / "logs").mkdir(parents=True)
    latest = runs / "latest"
    latest.unlink(missing_ok=True)
    latest.symlink_to(name)
    return msgspec.structs.replace(config, name=name, runs_dir=str(runs)), run_dir


def run_pipeline(config: RunConfig, progress: bool = True) -> int:
    from pipeline import monitor
    from pipeline.evaluate import Evaluator
    from topics.admin import ensure_topics
    from topics.broker import EmbeddedBroker

    started = time.time()
    config, run_dir = prepare_run(config)
    print(f"asyncrl: run directory {run_dir}", file=sys.stderr)
    if not config.model.path:
        from pipeline.demo_model import prepare_demo_model

        model_dir = prepare_demo_model(run_dir / "model", seed=config.seed, task_seed=config.seed,
                                       steps=config.trainer.warmup_steps, progress=progress)
        config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=str(model_dir)))
    evaluator = Evaluator.for_config(config)
    base_accuracy = evaluator.accuracy() if evaluator else None

    broker = None
    if not config.broker.bootstrap:
        broker = EmbeddedBroker(run_dir / "broker.log").start()
        config = msgspec.structs.replace(config, broker=msgspec.structs.replace(config.broker, bootstrap=broker.bootstrap))
    workers: list[WorkerProcess] = []
    try:
        layout = runtime.topic_layout(config)
        asyncio.run(ensure_topics(config.broker.bootstrap, layout.names, layout.partitions))
        config_path = run_dir / "config.yaml"
        save_config(config, config_path)
        roles = ["trainer", "reward", "prompts"] + ["rollout"] * config.rollout.workers
        for index, role in enumerate(roles):
            workers.append(WorkerProcess(role, index, config_path, run_dir / "logs" / f"{role}-{index}.stdout"))
            workers[-1].start()
        outcome = monitor.follow(config, run_dir, workers, evaluator, base_accuracy, started, progress)
    finally:
        for role in STOP_ORDER:
            for worker in workers:
                if worker.role == role:
                    worker.stop()
        if broker is not None:
            broker.stop()
    summary = monitor.finish(config, run_dir, evaluator, base_accuracy, outcome, started)
    print(json.dumps(summary, indent=2))
    return 0 if outcome == "finished" else 1

