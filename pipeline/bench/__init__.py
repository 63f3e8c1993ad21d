"""Benchmarks behind `asyncrl bench <name>`: module `pipeline.bench.<name>` runs one with `run(args) -> int`.

Imported only when a bench runs, so the CLI's `--help` stays instant.
"""

import argparse
import importlib
import os
import platform
from pathlib import Path

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
    from pipeline.launch import run_pipeline

    if run_pipeline(config, progress=progress) != 0:
        return None
    return (Path(config.runs_dir) / "latest").resolve()  # new_run_dir links the run it made as `latest`


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(f"pipeline.bench.{args.bench}").run(args)
