"""`asyncrl prepare`: what a deployment's workers need before they start (compose, Slurm)."""

from __future__ import annotations

import argparse

from pipeline.commands.options import add_config_arguments, given_config


def add_parser(commands: argparse._SubParsersAction) -> None:
    prepare = commands.add_parser("prepare", help="make the model, topics and runs/<name>/config.yaml for a deployment")
    add_config_arguments(prepare, "dotted overrides; broker.bootstrap is required")
    prepare.add_argument(
        "--embedded-broker",
        action="store_true",
        help="broker.bootstrap is an embedded broker (topics in memory): the trainer exports them before checkpoints",
    )
    prepare.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    """The model, topics and config.yaml of a deployment, on the broker its workers will use. A run directory
    with a checkpoint is a resumed deployment: a `resume` line for summary.json's resumed_from."""
    from msgspec.structs import replace

    from pipeline.config import ConfigError
    from pipeline.launch.resume import checkpoint_step
    from pipeline.launch.run_dir import check_dataset, prepare
    from pipeline.monitor import note_start

    config = given_config(args)[2]
    if not config.broker.bootstrap:
        raise ConfigError("prepare needs broker.bootstrap=HOST:PORT (the broker the workers will use)")
    check_dataset(config)
    launcher = replace(config.launcher, embedded_broker=args.embedded_broker)
    path = prepare(replace(config, launcher=launcher), deployment=True)[1]
    step = checkpoint_step(path.parent)
    if step is not None:
        note_start(path.parent, step)
    print(path)
    return 0
