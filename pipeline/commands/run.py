"""`asyncrl run`: a whole pipeline on this machine (`pipeline.launch`)."""

from __future__ import annotations

import argparse

from pipeline.commands.options import add_config_arguments, add_no_progress, given_config


def add_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="run a whole pipeline locally (the built-in demo with no config)")
    add_config_arguments(run, "dotted overrides, e.g. trainer.optim.lr=1e-4")
    run.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, start nothing")
    run.add_argument("--explain", action="store_true", help="with --dry-run: list every field with its description")
    add_no_progress(run, "no progress bar (logs only)")
    run.add_argument(
        "--in-process",
        action="store_true",
        help="every role in this process, to read or debug (pipeline/in_process.py)",
    )
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped, failed or killed run from its last checkpoint, with its own config.yaml "
        "(every step trained once across the stop)",
    )
    run.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    if args.resume:
        return resume(args)
    from pipeline.config import RUN_DIR_NOTE, explain, on_one_machine, resolve, to_yaml

    config = given_config(args)[2]
    if args.dry_run:
        config = resolve(on_one_machine(config))
        print(RUN_DIR_NOTE + (explain(config) if args.explain else to_yaml(config)), end="")
        return 0
    if args.in_process:
        from pipeline.in_process import run_in_process

        return run_in_process(config, progress=not args.no_progress)
    from pipeline.launch.local_run import run_pipeline

    return run_pipeline(config, progress=not args.no_progress)


def resume(args: argparse.Namespace) -> int:
    """`asyncrl run --resume RUN_DIR`: the run's own config.yaml runs again, nothing given instead."""
    from pathlib import Path

    from pipeline.config import ConfigError
    from pipeline.launch.local_run import resume_pipeline

    if args.config or args.overrides or args.dry_run or args.in_process:
        raise ConfigError(
            "--resume runs the run's own config.yaml: give no config, override, --dry-run or --in-process with it"
        )
    return resume_pipeline(Path(args.resume), progress=not args.no_progress)
