"""The worker roles: which module runs each, and the command line that starts one (`asyncrl worker ROLE`).

The standard library only at import: the CLI's parser takes its role names from here, the fork server its
imports, the launcher its command lines."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

WORKER_MODULES = {
    "prompts": "workers.prompt_source",
    "rollout": "workers.rollout.worker",
    "reward": "workers.reward.worker",
    "trainer": "workers.trainer.worker",
    "eval": "workers.evaluator.worker",  # the launcher's own: the run's held-out evaluation
}
LAZY_IMPORTS = {"eval": ("workers.evaluator.scoring",)}  # what a role's module imports only in its main


def worker_argv(role: str, config_path: Path) -> list[str]:
    """The command line of `asyncrl worker ROLE`, as the launcher would start it."""
    return [sys.executable, "-m", "pipeline.cli", "worker", role, "--config", str(config_path)]


def run_worker(role: str, config_path: str, overrides: list[str]) -> None:
    """The body of `asyncrl worker <role>`: run until done or SIGTERM. A bad config fails before the role's imports
    (torch and transformers: 2.5-4 CPU-seconds; a forked worker has them already)."""
    from pipeline.config import load_config, resolve
    from workers import runtime

    config = load_config(config_path, overrides)
    module = importlib.import_module(WORKER_MODULES[role])
    runtime.run_until_stopped(lambda stop: module.main(resolve(config), stop))
