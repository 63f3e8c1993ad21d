"""`asyncrl worker ROLE`: one worker process, as compose and Slurm start it (`pipeline.roles`)."""

from __future__ import annotations

import argparse

from pipeline.roles import WORKER_MODULES


def add_parser(commands: argparse._SubParsersAction) -> None:
    worker = commands.add_parser("worker", help="run one worker process (what compose and Slurm start)")
    worker.add_argument("role", choices=tuple(WORKER_MODULES))
    worker.add_argument("--config", required=True, help="the resolved run config (runs/<name>/config.yaml)")
    worker.add_argument("overrides", nargs="*", help="dotted overrides")
    worker.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    from pipeline.roles import run_worker

    run_worker(args.role, args.config, args.overrides)
    return 0
