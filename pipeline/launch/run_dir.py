"""A run's directory made and checked before anything starts: its name, `latest`, the dataset, the chat
template, W&B, then everything workers need (`prepare`: model, key, topics, config.yaml)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from pathlib import Path

import msgspec

from pipeline.config import ConfigError, derived_weights_dir, load_config, resolve, save_config
from pipeline.model_cache import model_path
from schemas.config import AUTO, RunConfig
from workers import runtime


def new_run_dir(config: RunConfig) -> RunConfig:
    """A fresh name `<name>-<time>` under runs_dir (the launcher links it as `latest` at once).
    Another run's config.yaml run again names that run's weights directory: the new run gets its own. One of
    the user's choice must hold no weight versions: another run's would pass for this one's (the newest on
    disk is what `asyncrl export` and a resumed trainer take as the run's)."""
    checkpoint = config.trainer.checkpoint
    if checkpoint.weights_dir == derived_weights_dir(config):  # that run's own: derive the new run's
        checkpoint = msgspec.structs.replace(checkpoint, weights_dir=AUTO)
    elif checkpoint.weights_dir != AUTO and (held := runtime.stored_versions(Path(checkpoint.weights_dir))):
        raise ConfigError(
            f"trainer.checkpoint.weights_dir {checkpoint.weights_dir} holds weight versions already (v{held[0]} to "
            f"v{held[-1]}, another run's): give this run an empty directory"
        )
    runs = Path(config.runs_dir).resolve()
    name = f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    while (runs / name).exists():
        name += "x"
    (runs / name).mkdir(parents=True)
    trainer = msgspec.structs.replace(config.trainer, checkpoint=checkpoint)
    return msgspec.structs.replace(config, name=name, runs_dir=str(runs), trainer=trainer)


def link_latest(run_dir: Path) -> None:
    """`<runs_dir>/latest` -> run_dir, replaced in one rename: the newest run started, from its start (one stopped
    in its warm-up has no config.yaml yet, and `--resume` says so rather than resume the run before it)."""
    link = run_dir.parent / f".latest-{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(run_dir.name)
    link.replace(run_dir.parent / "latest")


def check_dataset(config: RunConfig) -> None:
    """Fail before anything starts when the dataset has no usable row (bad rows alone go to dead-letter), or
    the model is a short name not imported yet."""
    from workers.rows import load_rows

    config = msgspec.structs.replace(
        config, model=msgspec.structs.replace(config.model, path=model_path(config.model.path))
    )
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


def prepare(config: RunConfig, progress: bool = True, deployment: bool = False) -> tuple[RunConfig, Path]:
    """Everything workers need before they start: the model (pre-flight checked), the run's key, the topics,
    `config.yaml`.

    Idempotent for deployments (compose, Slurm): a run directory that already has
    its config.yaml keeps it (and its model); the topics are ensured every time. A deployment's workers always
    join their consumer groups (`launcher.sole_consumers` false), whatever the config it was prepared from says.
    Returns the resolved config and its path.
    """
    from pipeline.preflight import check_workflow, learning_rate_warning, preflight
    from topics.admin import BrokerUnreachable, ensure_topics
    from workers.announce import create_key

    run_dir = Path(config.runs_dir).resolve() / config.name
    config_path = run_dir / "config.yaml"
    if config_path.exists():
        config = load_config(config_path)
    else:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        config = msgspec.structs.replace(config, runs_dir=str(run_dir.parent))
    if deployment:  # its workers of a role may be scaled: each joins the role's consumer group
        config = msgspec.structs.replace(
            config, launcher=msgspec.structs.replace(config.launcher, cores=0, sole_consumers=False)
        )
    config = resolve(config)  # the task's defaults (warm-up steps) before the demo model is built
    check_workflow(config)
    if not config.model.path:
        from pipeline.demo_model import prepare_demo_model
        from workers.rollout.workflow import load_workflow

        model_dir = prepare_demo_model(
            run_dir / "model",
            config.data.task,
            seed=config.seed,
            task_seed=config.seed,
            steps=config.model.warmup_steps,
            progress=progress,
            held_out=config.data.held_out,
            workflow=load_workflow(config.rollout.workflow),
        )
        config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=str(model_dir)))
    config = resolve(config)
    preflight(config)  # what would crash-loop the workers, as one line with the fix, before any starts
    if warning := learning_rate_warning(config, run_dir / "model"):  # the demo model's own rate suits it
        print(warning, file=sys.stderr)
    create_key(run_dir)  # once: the trainer signs every weight announcement with it (workers.announce)
    layout = runtime.topic_layout(config)  # every time: a broker may have lost its topics
    try:  # none without a broker: the in-process run's topics are in its memory
        if config.broker.bootstrap:
            asyncio.run(ensure_topics(config.broker.bootstrap, layout.names, layout.partitions))
    except BrokerUnreachable:
        raise ConfigError(
            f"no broker answers at broker.bootstrap={config.broker.bootstrap}: start it, or leave "
            "broker.bootstrap empty for an embedded one"
        ) from None
    save_config(config, config_path)
    return config, config_path
