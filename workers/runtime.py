"""What every worker process shares: its run directory, JSON logs, metrics, clean stop."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import structlog

from schemas.config import RunConfig
from topics.names import TopicLayout


def run_dir(config: RunConfig) -> Path:
    return Path(config.runs_dir) / config.name


def weights_dir(config: RunConfig) -> Path:
    return Path(config.trainer.weights_dir) if config.trainer.weights_dir else run_dir(config) / "weights"


def worker_id(role: str) -> str:
    """Unique per process and host, stable in logs: '<role>-<host>-<pid>'."""
    return f"{role}-{os.uname().nodename}-{os.getpid()}"


def configure_logging(log_path: Path) -> structlog.stdlib.BoundLogger:
    """structlog as JSON lines into the worker's own log file (and warnings to stderr)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(logging.WARNING)
    stderr.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler, stderr]
    root.setLevel(logging.INFO)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger()


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl (one write per line, safe across processes)."""

    def __init__(self, path: Path, source: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.source = path, source

    def write(self, **fields: Any) -> None:
        line = json.dumps({"time": time.time(), "source": self.source, **fields}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` with SIGTERM/SIGINT setting `stop`, so a worker ends its loop cleanly.

    The handlers are process-wide (not the loop's), so a signal that arrives while
    the worker is already on its way out is still absorbed rather than killing it.
    """

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def request_stop(signum, frame) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(stop.set)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, request_stop)
        await main(stop)

    asyncio.run(wrapper())


def topic_layout(config: RunConfig) -> TopicLayout:
    return TopicLayout(config.broker.topic_prefix, config.broker.partitions)


def bootstrap(config: RunConfig) -> str:
    if not config.broker.bootstrap:
        raise ValueError("broker.bootstrap is empty: a worker needs a running broker (asyncrl run starts one)")
    return config.broker.bootstrap
