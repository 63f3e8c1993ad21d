"""Benchmarks behind `asyncrl bench <name>`: module `pipeline.bench.<name>` runs one with `run(args) -> int`.

Imported only when a bench runs, so the CLI's `--help` stays instant.
"""

import argparse
import importlib


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(f"pipeline.bench.{args.bench}").run(args)
