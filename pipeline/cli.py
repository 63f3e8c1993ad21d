"""The `asyncrl` command. Parsing imports nothing heavy, so `--help` is instant."""

from __future__ import annotations

import argparse
import sys

ROLES = ("prompts", "rollout", "reward", "trainer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Fully asynchronous RL for LLM reasoning on Kafka.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a whole pipeline locally (the built-in demo with no config)")
    run.add_argument("config", nargs="?", help="YAML run config (default: the built-in demo)")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-4")
    run.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, start nothing")
    run.add_argument("--explain", action="store_true", help="with --dry-run: list every field with its description")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")

    prepare = commands.add_parser("prepare", help="make the model, topics and runs/<name>/config.yaml for a deployment")
    prepare.add_argument("config", nargs="?", help="YAML run config (default: the built-in demo)")
    prepare.add_argument("overrides", nargs="*", help="dotted overrides; broker.bootstrap is required")

    worker = commands.add_parser("worker", help="run one worker process (what compose and Slurm start)")
    worker.add_argument("role", choices=ROLES)
    worker.add_argument("--config", required=True, help="the resolved run config (runs/<name>/config.yaml)")
    worker.add_argument("overrides", nargs="*", help="dotted overrides")

    broker = commands.add_parser("broker", help="run the embedded Kafka-protocol broker in the foreground")
    broker.add_argument("--port", type=int, default=None, help="loopback port (default: a free one)")
    broker.add_argument("--log", default="broker.log", help="broker log file")
    return parser


def split_config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """`asyncrl run trainer.lr=1e-4` has no config file: the first word is an override."""
    if config is not None and "=" in config:
        return None, [config, *overrides]
    return config, overrides


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    if stray or (extra and args.command == "broker"):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:  # overrides written after an option, e.g. `run --no-progress trainer.lr=1e-4`
        args.overrides = [*args.overrides, *extra]
    from pipeline.config import ConfigError, explain, load_config, to_yaml

    try:
        if args.command == "broker":
            from topics.broker import serve_forever

            serve_forever(args.port, args.log)
            return 0
        if args.command == "worker":
            from pipeline.launch import run_worker

            run_worker(args.role, load_config(args.config, args.overrides))
            return 0
        path, overrides = split_config_and_overrides(args.config, args.overrides)
        config = load_config(path or default_config(), overrides)
        if args.command == "prepare":
            from pipeline.launch import check_dataset, prepare

            if not config.broker.bootstrap:
                raise ConfigError("prepare needs broker.bootstrap=HOST:PORT (the broker the workers will use)")
            check_dataset(config)

            print(prepare(config)[1])
            return 0
        if args.dry_run:
            print(explain() if args.explain else to_yaml(config), end="")
            return 0
        from pipeline.launch import run_pipeline

        return run_pipeline(config, progress=not args.no_progress)
    except ConfigError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2


def default_config() -> str:
    from pathlib import Path

    return str(Path(__file__).parent / "configs" / "demo.yaml")


if __name__ == "__main__":
    sys.exit(main())
