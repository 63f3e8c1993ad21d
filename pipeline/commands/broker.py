"""`asyncrl broker`: the embedded Kafka-protocol broker in the foreground (`topics.broker`)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    broker = commands.add_parser("broker", help="run the embedded Kafka-protocol broker in the foreground")
    broker.add_argument("--port", type=int, default=None, help="loopback port (default: a free one)")
    broker.add_argument("--log", default="broker.log", help="broker log file")
    broker.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    from topics.broker import serve_forever

    serve_forever(args.port, args.log)
    return 0
