"""Benchmarks behind `asyncrl bench <name>`: module `pipeline.bench.<name>` runs one with `run(args) -> int`.

Imported only when a bench runs, so the CLI's `--help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # msgspec (schemas, workers.cores) is imported where it is used: gpu-check starts without it
    from schemas.config import RunConfig


def machine() -> dict:
    """What a benchmark's numbers depend on, for its JSON."""
    import torch
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def run_to_end(config: RunConfig, progress: bool) -> Path | None:
    """One whole `asyncrl run` of `config`: its run directory, or None if it did not finish."""
    from pipeline.launch.local_run import run_pipeline

    if run_pipeline(config, progress=progress) != 0:
        return None
    return (Path(config.runs_dir) / "latest").resolve()  # the launcher links the run it made as `latest`


def task_config(task: str, overrides: list[str]) -> RunConfig:
    """`task`'s shipped config (pipeline/configs/<task>.yaml, or a YAML file given by path), then `overrides`."""
    from pipeline.config import load_config
    from pipeline.shipped_configs import config_file

    return load_config(config_file(task), overrides)


REAL_MODEL_TASK = "smollm2-math"  # the shipped real-model config that `--model` runs on


def bench_task(args: argparse.Namespace, demo_task: str) -> str:
    """The config a bench runs: --task, else the real-model config with --model, else the bench's demo task."""
    return args.task or (REAL_MODEL_TASK if args.model else demo_task)


def model_overrides(args: argparse.Namespace) -> list[str]:
    """--model (a directory or an imported short name) as model.path, --eval-rows as eval.max_rows."""
    model = [f"model.path={args.model}"] if args.model else []
    return [*model, *([] if args.eval_rows is None else [f"eval.max_rows={args.eval_rows}"])]


def task_label(task: str) -> str:
    """`--task` as a file-name part: the shipped config's name, or a YAML file's stem."""
    return Path(task).stem if task.endswith((".yaml", ".yml")) else task


def build_demo_model(config: RunConfig, out_dir: Path, progress: bool) -> str:
    """The task's demo model for `config`'s seed, built with the arguments `asyncrl run` (pipeline.launch.run_dir.prepare) gives it."""
    from pipeline.config import resolve
    from pipeline.demo_model import prepare_demo_model
    from workers.rollout.workflow import load_workflow

    model_dir = prepare_demo_model(
        out_dir,
        config.data.task,
        seed=config.seed,
        task_seed=config.seed,
        steps=resolve(config).model.warmup_steps,
        progress=progress,
        held_out=config.data.held_out,
        workflow=load_workflow(config.rollout.workflow),
    )
    return str(model_dir)


def with_model(config: RunConfig, path: str) -> RunConfig:
    import msgspec

    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=path))


def cores_given(config: RunConfig, cpu_count: int | None, usable_cores: int) -> dict:
    """The CPU each role is given (processes x torch threads; automatic threads as `asyncrl run` resolves them
    on `usable_cores`) and what the machine has: a run's demand vs supply."""
    from pipeline.config import threads_on

    trainer, rollout = threads_on(usable_cores, config)
    roles = {
        "rollout": {"processes": config.rollout.workers, "threads": rollout},
        "trainer": {"processes": config.trainer.ranks, "threads": trainer},
        "reward": {"processes": config.reward.processes, "threads": 1},  # scoring processes, one thread each
    }
    threads = sum(role["processes"] * role["threads"] for role in roles.values())
    return {**roles, "threads_total": threads, "usable_cores": usable_cores, "cpu_count": cpu_count}


def cores_line(cores: dict) -> str:
    """`cores_given` in one line."""
    roles = ", ".join(
        f"{role} {cores[role]['processes']} process(es) x {cores[role]['threads']} thread(s)"
        if cores[role]["processes"] or role != "reward"
        else "reward scored in the reward worker (reward.processes=0)"
        for role in ("rollout", "trainer", "reward")
    )
    return (
        f"cores given: {roles}; {cores['threads_total']} threads in all "
        f"on {cores['usable_cores']} usable cores (machine: {cores['cpu_count']})"
    )


def times(ratio: float | None) -> str:
    """A ratio as printed: '1.23x', or why there is none."""
    return "not measured" if ratio is None else f"{ratio:.2f}x"


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(f"pipeline.bench.{args.bench}").run(args)
