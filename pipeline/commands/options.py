"""Options that several commands share, each declared once."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas.config import RunConfig


def add_config_arguments(parser: argparse.ArgumentParser, overrides_help: str) -> None:
    """A run config (a YAML file or a shipped config's name) and dotted overrides after it."""
    parser.add_argument(
        "config",
        nargs="?",
        help="YAML run config, or a shipped one by name: arith (the default, the demo), chain, code, smollm2-math",
    )
    parser.add_argument("overrides", nargs="*", help=overrides_help)


def add_no_progress(parser: argparse.ArgumentParser, help: str = "no progress bars") -> None:
    parser.add_argument("--no-progress", action="store_true", help=help)


def add_task_option(parser: argparse.ArgumentParser, default: str = "chain", real_model: str = "") -> None:
    """A benchmark's task: every run is that config plus the bench's settings. With `real_model` (a shipped
    config's name) the option defaults to None: the bench picks `default`, or `real_model` under --model."""
    parser.add_argument(
        "--task",
        default=None if real_model else default,
        help="a shipped config's name (pipeline/configs/<task>.yaml: arith, chain) or a YAML config file; "
        "every run is that config plus the bench's settings "
        + (f"(default: {default}; with --model: {real_model})" if real_model else "(default: %(default)s)"),
    )


def add_device_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")


def split_config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """`asyncrl run trainer.optim.lr=1e-4` has no config file: the first word is an override."""
    if config is not None and "=" in config:
        return None, [config, *overrides]
    return config, overrides


def given_config(args: argparse.Namespace) -> tuple[str, list[str], RunConfig]:
    """The config file the arguments name (a shipped one by name, the demo's when none), its overrides, and the
    config loaded from both."""
    from pipeline.config import load_config
    from pipeline.shipped_configs import config_file

    path, overrides = split_config_and_overrides(args.config, args.overrides)
    path = config_file(path)
    return path, overrides, load_config(path, overrides)
