"""`asyncrl topics`: a broker's topics listed, a run's topics exported or imported (pipeline/replay.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def add_parser(commands: argparse._SubParsersAction) -> None:
    topics = commands.add_parser(
        "topics", help="list topics with offsets and counts per partition; export or import a run's topics"
    )
    add_broker_options(topics)
    actions = topics.add_subparsers(dest="action")
    export = actions.add_parser("export", help="write every topic of a run to one file")
    add_broker_options(export, inherited=True)
    export.add_argument("--out", required=True, help="the file to write")
    load = actions.add_parser("import", help="load an export into a broker (empty topics, same partitions and offsets)")
    load.add_argument("file", help="a file written by `asyncrl topics export`")
    add_broker_options(load, inherited=True)
    topics.set_defaults(handle=handle)


def add_broker_options(parser: argparse.ArgumentParser, inherited: bool = False) -> None:
    """--config/--bootstrap/--prefix; a subcommand's copy leaves its parent's values alone unless given."""
    default = argparse.SUPPRESS if inherited else None
    parser.add_argument(
        "--config", default=default, help="a run's resolved config (runs/<run>/config.yaml): broker, prefix, model"
    )
    parser.add_argument("--bootstrap", default=default, help="broker HOST:PORT (instead of the config's)")
    parser.add_argument("--prefix", default=default, help="topic prefix (instead of the config's)")


def handle(args: argparse.Namespace) -> int:
    from pipeline.replay import topics_command

    return reading_topics(topics_command, args)


def reading_topics(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`command` (`asyncrl topics` or `asyncrl replay`): a missing topic or broker is a message, not a traceback."""
    from topics.export import ExportError
    from topics.inspect import BrokerError

    try:
        return command(args)
    except BrokerError as exc:
        print(
            f"asyncrl: broker error: {exc} (a finished run's embedded broker is gone; "
            "`asyncrl replay ... --export FILE` reads its export)",
            file=sys.stderr,
        )
    except (LookupError, ExportError, TimeoutError, OSError) as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
    return 1
