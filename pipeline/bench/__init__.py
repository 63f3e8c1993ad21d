"""Benchmarks behind `asyncrl bench <name>`: module `pipeline.bench.<name>` runs one with `run(args) -> int`.

Imported only when a bench runs, so the CLI's `--help` stays instant.
"""

import argparse
import importlib
import os
import platform


def machine() -> dict:
    """What a benchmark's numbers depend on, for its JSON."""
    import torch
    import transformers

    return {"cpu_count": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(f"pipeline.bench.{args.bench}").run(args)
