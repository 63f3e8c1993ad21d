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
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pipeline.config import ConfigError, load_config, resolve, save_config
from schemas.config import RunConfig
from workers import runtime

WORKER_MODULES = {
    "prompts": "workers.prompt_source",
    "rollout": "workers.rollout.worker",
    "reward": "workers.reward.worker",
    "trainer": "workers.trainer.worker",
}
STOP_ORDER = ("prompts", "rollout", "reward", "trainer")  # the trainer last: it checkpoints on stop
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are processes already


def run_worker(role: str, config: RunConfig) -> None:
    """The body of `asyncrl worker <role>`: run until done or SIGTERM."""
    module = importlib.import_module(WORKER_MODULES[role])
    runtime.run_until_stopped(lambda stop: module.main(resolve(config), stop))


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
    ranks: int = 1  # > 1: that many processes under torchrun (the trainer's FSDP2 ranks)
    process: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> None:
        worker = ["-m", "pipeline.cli", "worker", self.role, "--config", str(self.config_path)]
        if self.ranks > 1:  # torchrun forwards SIGTERM to its ranks and ends them all when one fails
            worker = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.ranks}", *worker]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, *worker],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
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


def new_run_dir(config: RunConfig) -> RunConfig:
    """A fresh name `<name>-<time>` under runs_dir, linked as `<runs_dir>/latest`."""
    runs = Path(config.runs_dir).resolve()
    name = f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    while (runs / name).exists():
        name += "x"
    (runs / name).mkdir(parents=True)
    latest = runs / "latest"
    latest.unlink(missing_ok=True)
    latest.symlink_to(name)
    return msgspec.structs.replace(config, name=name, runs_dir=str(runs))


def check_dataset(config: RunConfig) -> None:
    """Fail before anything starts when the dataset has no usable row (bad rows alone go to dead-letter)."""
    from workers.prompt_source import load_rows

    try:
        rows, bad = load_rows(config)
    except OSError as exc:
        raise ConfigError(f"data.source {config.data.source}: {exc.strerror}") from exc
    except ValueError as exc:  # the task's own rows: e.g. a held-out split as large as the task
        raise ConfigError(str(exc)) from None
    if not rows:
        reasons = "; ".join(str(row) for row in bad[:3])
        raise ConfigError(f"data.source {config.data.source} has no usable row{': ' + reasons if reasons else ''}")
    check_template(config)


def check_template(config: RunConfig) -> None:
    """Fail before anything starts when data.template=chat has no chat template to apply: the demo model's
    tokenizer has none, and a tokenizer without one (or whose template never opens the assistant's turn)
    would otherwise stop the prompt source only once the run is up."""
    if config.data.template != "chat":
        return
    if not config.model.path:
        raise ConfigError("data.template=chat needs model.path: the demo model's tokenizer has no chat template")
    from transformers import AutoTokenizer

    from workers.models import check_chat_template

    try:
        check_chat_template(AutoTokenizer.from_pretrained(config.model.path))
    except (OSError, ValueError) as exc:
        reason = next(iter(str(exc).splitlines()), type(exc).__name__)
        raise ConfigError(f"model.path {config.model.path}: {reason}") from None


def check_wandb(config: RunConfig) -> None:
    """Fail before anything starts when W&B is configured but wandb is not installed (it is an extra)."""
    if config.telemetry.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("telemetry.wandb_project is set but wandb is not installed: pip install 'asyncrl[wandb]'")


def prepare(config: RunConfig, progress: bool = True) -> tuple[RunConfig, Path]:
    """Everything workers need before they start: the model, the topics, `config.yaml`.

    Idempotent for deployments (compose, Slurm): a run directory that already has
    its config.yaml keeps it (and its model); the topics are ensured every time.
    Returns the resolved config and its path.
    """
    from topics.admin import ensure_topics

    run_dir = Path(config.runs_dir).resolve() / config.name
    config_path = run_dir / "config.yaml"
    if config_path.exists():
        config = load_config(config_path)
    else:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        config = msgspec.structs.replace(config, runs_dir=str(run_dir.parent))
    config = resolve(config)  # the task's defaults (warm-up steps) before the demo model is built
    if not config.model.path:
        from pipeline.demo_model import prepare_demo_model

        model_dir = prepare_demo_model(
            run_dir / "model",
            config.data.task,
            seed=config.seed,
            task_seed=config.seed,
            steps=config.model.warmup_steps,
            progress=progress,
            held_out=config.data.held_out,
        )
        config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=str(model_dir)))
    config = resolve(config)
    layout = runtime.topic_layout(config)  # every time: a broker may have lost its topics
    asyncio.run(ensure_topics(config.broker.bootstrap, layout.names, layout.partitions))
    save_config(config, config_path)
    return config, config_path


def export_topics_quietly(config: RunConfig, run_dir: Path) -> None:
    """Write every topic to `<run dir>/topics.export` for replay; a failure costs the file, not the run."""
    from topics.export import export_topics

    try:
        asyncio.run(export_topics(config.broker.bootstrap, run_dir / "topics.export", config.broker.topic_prefix))
    except Exception as exc:  # the run's results are already safe; say what is missing
        print(f"asyncrl: topics not exported ({exc})", file=sys.stderr)


def run_pipeline(config: RunConfig, progress: bool = True) -> int:
    from pipeline import monitor
    from pipeline.evaluate import NO_EVAL_SET, Evaluator, rows_for_config
    from pipeline.export_model import export_final
    from topics.broker import EmbeddedBroker

    started = time.time()
    check_dataset(config)
    check_wandb(config)
    eval_rows = rows_for_config(config)  # before anything starts: a missing data.eval_source is a config error
    config = new_run_dir(config)
    run_dir = runtime.run_dir(config)
    print(f"asyncrl: run directory {run_dir}", file=sys.stderr)
    # before the broker and the model: a W&B problem (no login) shows at once; W&B gets the config as given
    wandb_stream = monitor.WandbStream(config, run_dir) if config.telemetry.wandb_project else None
    broker, workers = None, []
    try:
        if not config.broker.bootstrap:
            broker = EmbeddedBroker(run_dir / "broker.log").start()
            config = msgspec.structs.replace(
                config, broker=msgspec.structs.replace(config.broker, bootstrap=broker.bootstrap)
            )
        config, config_path = prepare(config, progress)
        evaluator = Evaluator.for_config(config, eval_rows)
        if evaluator is None:
            print(NO_EVAL_SET, file=sys.stderr)
        base = monitor.evaluate_version(config, run_dir, evaluator, 0) if evaluator else None
        base_accuracy = base["heldout_accuracy"] if base else None
        roles = ["trainer", "reward", "prompts"] + ["rollout"] * config.rollout.workers
        for index, role in enumerate(roles):
            ranks = config.trainer.ranks if role == "trainer" else 1
            workers.append(WorkerProcess(role, index, config_path, run_dir / "logs" / f"{role}-{index}.stdout", ranks))
            workers[-1].start()
        outcome = monitor.follow(config, run_dir, workers, evaluator, base_accuracy, started, progress, wandb_stream)
    finally:
        for role in STOP_ORDER:
            for worker in workers:
                if worker.role == role:
                    worker.stop()
        if broker is not None:
            export_topics_quietly(config, run_dir)  # the broker keeps them in memory only
            broker.stop()
    summary = monitor.finish(config, run_dir, evaluator, base_accuracy, outcome, started, wandb_stream)
    summary = export_final(run_dir, summary)  # <run dir>/final-model, as summary.json's exported_model
    print(json.dumps(summary, indent=2))
    return 0 if outcome == "finished" else 1
