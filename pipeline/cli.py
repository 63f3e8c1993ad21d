"""The `asyncrl` command: one parser built from the commands' own modules (`pipeline.commands`), then the
command's handler. Parsing imports nothing heavy, so `--help` is instant."""

from __future__ import annotations

import argparse
import gc
import sys

from pipeline import slurm
from pipeline.chaos import cli as chaos
from pipeline.commands import bench, broker, export, gpu_check, model, prepare, replay, topics, worker
from pipeline.commands import eval as evaluate
from pipeline.commands import run as run_command
from schemas.errors import ConfigError

COMMANDS = (
    run_command,
    prepare,
    worker,
    broker,
    evaluate,
    export,
    model,
    topics,
    replay,
    bench,
    gpu_check,
    slurm,
    chaos,
)


def build_parser() -> argparse.ArgumentParser:
    """Every command's options: what `asyncrl --help` and the CLI reference show."""
    parser = argparse.ArgumentParser(prog="asyncrl", description="Fully asynchronous RL for LLM reasoning on Kafka.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; overrides may also come after an option (`run --no-progress trainer.optim.lr=1e-4`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    if stray or (extra and not hasattr(args, "overrides")):  # only commands that take overrides
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; an unusable config or input is one line on stderr and exit code 2."""
    args = parse(argv)
    handle = vars(args).pop("handle")  # the arguments alone go on: benchmarks and chaos write them to their reports
    try:
        return handle(args)
    except ConfigError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2


def run(argv: list[str] | None = None) -> int:
    """The process's entry (`asyncrl`, `python -m pipeline.cli`): `main`, then an exit that leaves what the
    process holds out of the interpreter's last garbage collections. They walk every object still tracked,
    torch's and transformers' imported code above all: ~1 s of each worker's and the launcher's exit here.
    Objects freed by reference counting still are; cycles are left to the process's end."""
    try:
        return main(argv)
    finally:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(run())
