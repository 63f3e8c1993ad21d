"""What every worker process shares: its context (id, logs, traces, metrics, transport), clean stop.

`WorkerContext.start(config, role)` is the first line of every worker's `main`;
the rest of the loop sees only the context.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from schemas.config import AUTO, RunConfig
from topics.names import TopicLayout
from topics.transport import Transport

LIBC = ctypes.CDLL(ctypes.util.find_library("c"))  # the C library, for malloc_trim where it is glibc


def run_dir(config: RunConfig) -> Path:
    return Path(config.runs_dir) / config.name


def topics_export_path(config: RunConfig) -> Path:
    """Where a run on the embedded broker keeps its topics (topics.export): they die with the broker."""
    return run_dir(config) / "topics.export"


def weights_dir(config: RunConfig) -> Path:
    if config.trainer.checkpoint.weights_dir == AUTO:
        raise ValueError("the config is not resolved: its weights dir is auto (pipeline.config.resolve fills it)")
    return Path(config.trainer.checkpoint.weights_dir)


def version_path(weights_dir: Path, version: int) -> Path:
    """Where version `version`'s weights file lives (torch-free: the launcher names files without importing torch)."""
    return weights_dir / f"v{version:06d}.safetensors"


def delta_path(weights_dir: Path, version: int) -> Path:
    """Where version `version`'s delta file lives, when it was published as a delta (`workers.weight_deltas`)."""
    return weights_dir / f"v{version:06d}.delta.safetensors"


def delta_versions_on_disk(weights_dir: Path) -> list[int]:
    """The versions published as deltas whose files are in `weights_dir`, oldest first."""
    return sorted(int(p.name[1:7]) for p in weights_dir.glob("v*.delta.safetensors") if p.name[1:7].isdigit())


def versions_on_disk(weights_dir: Path) -> list[int]:
    """The versions whose weights files are in `weights_dir`, oldest first."""
    return sorted(int(p.stem[1:]) for p in weights_dir.glob("v*.safetensors") if p.stem[1:].isdigit())


def stored_versions(weights_dir: Path) -> list[int]:
    """The versions with a file in `weights_dir`, whole or delta, oldest first."""
    return sorted({*versions_on_disk(weights_dir), *delta_versions_on_disk(weights_dir)})


def stored_path(weights_dir: Path, version: int) -> Path:
    """The file holding version `version`: its whole file, else its delta file, else (neither there) the whole
    file's name."""
    whole, delta = version_path(weights_dir, version), delta_path(weights_dir, version)
    return delta if delta.is_file() and not whole.is_file() else whole


def node_name() -> str:
    """The node this process runs on: Slurm's name for it in a job step (nodes may share a host name), else
    the host's name."""
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def worker_id(role: str) -> str:
    """Unique per process and node, stable in logs: '<role>-<node>-<pid>'."""
    return f"{role}-{node_name()}-{os.getpid()}"


def configure_logging(log_path: Path) -> structlog.stdlib.BoundLogger:
    """structlog as JSON lines into the worker's own log file (and warnings to stderr), where the process's
    other loggers write too. The worker's lines go through a logger of the file's own, so that roles run in
    one process (`asyncrl run --in-process`) keep their files apart."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(logging.WARNING)
    stderr.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler, stderr]
    root.setLevel(logging.INFO)
    own = logging.getLogger(f"asyncrl.{log_path.stem}")
    own.handlers[:], own.propagate = [handler, stderr], False
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
    return structlog.get_logger(own.name)


class JsonLines:
    """Appends lines to a file shared by several processes: one write() per line, so lines never interleave."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def append(self, line: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def release_freed_memory() -> None:
    """Hand the memory freed in this process's malloc arenas back to the OS (glibc's malloc_trim; elsewhere
    nothing). A step that trains in a worker thread frees its activations into that thread's arena, and glibc
    keeps them: the trainer's peak resident memory crept from 3.7 to 10.6 GB over 70 steps of SmolLM2-135M."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class MetricsWriter:
    """One JSON object per line in metrics.jsonl, tagged with its source (trainer, eval)."""

    def __init__(self, path: Path, source: str):
        self.lines, self.source = JsonLines(path), source

    def write(self, **fields: Any) -> None:
        """A line of `fields`, with the time and this process's peak resident memory so far (summary.json keeps
        each role's largest)."""
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # Linux: kilobytes
        self.lines.append(json.dumps({"time": time.time(), "source": self.source, **fields, "peak_rss_mb": peak_mb}))


class JsonlSpanExporter(SpanExporter):
    """Finished spans as JSON lines in one file shared by every worker of the run."""

    def __init__(self, path: Path):
        self.lines = JsonLines(path)

    def export(self, spans) -> SpanExportResult:
        for span in spans:
            self.lines.append(span.to_json(indent=None))
        return SpanExportResult.SUCCESS


def configure_tracing(config: RunConfig, role: str) -> trace.Tracer:
    """The worker's tracer, from a provider of its own (roles run in one process, `asyncrl run --in-process`,
    keep their service names): OTLP/HTTP when an endpoint is configured
    (`telemetry.otlp_endpoint`, else the standard OTEL_EXPORTER_OTLP_ENDPOINT), else
    <run dir>/traces.jsonl.

    Sampling is decided at the root (the prompt source's release span) and followed
    by every child, so a sampled prompt is traced whole. Buffered spans are flushed
    when the process exits.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    endpoint = config.telemetry.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    else:
        exporter = JsonlSpanExporter(run_dir(config) / "traces.jsonl")
    provider = TracerProvider(
        resource=Resource.create({"service.name": f"asyncrl-{role}", "asyncrl.run": config.name}),
        sampler=ParentBased(TraceIdRatioBased(config.telemetry.sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer(f"asyncrl.{role}")


ORPHAN_GRACE_S = 5.0  # how long a worker whose launcher died may take to stop: no one will SIGKILL it


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` with SIGTERM/SIGINT setting `stop`, so a worker ends its loop cleanly.

    The handlers are process-wide (not the loop's), so a signal that arrives while
    the worker is already on its way out is still absorbed rather than killing it.
    A worker whose parent is gone (a SIGKILLed launcher sends SIGTERM through
    PR_SET_PDEATHSIG) exits ORPHAN_GRACE_S after the signal at the latest: its
    broker may have died with the launcher, and a delivery would wait 40 s for it.
    """
    parent = os.getppid()

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def request_stop(signum, frame) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(stop.set)
            if os.getppid() != parent:
                deadline = threading.Timer(ORPHAN_GRACE_S, os._exit, (1,))
                deadline.daemon = True  # a worker that ends in time exits at once
                deadline.start()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, request_stop)
        await main(stop)

    asyncio.run(wrapper())


def topic_layout(config: RunConfig) -> TopicLayout:
    return TopicLayout(config.broker.topic_prefix, config.broker.partitions)


def kafka_transport(config: RunConfig) -> Transport:
    """The run's broker, as the config names it (a resolved config: `pipeline.config.resolve`)."""
    from topics.kafka import KafkaTransport

    if not config.broker.bootstrap:
        raise ValueError("broker.bootstrap is empty: a worker needs a running broker (asyncrl run starts one)")
    return KafkaTransport(config.broker.bootstrap, topic_layout(config), config.broker.fetch_wait_ms)


@dataclass
class WorkerContext:
    """Built once per worker process: who it is, where it writes, how it talks to the others."""

    config: RunConfig
    role: str
    id: str  # '<role>-<host>-<pid>'
    log: structlog.stdlib.BoundLogger
    tracer: trace.Tracer
    transport: Transport

    @classmethod
    def start(cls, config: RunConfig, role: str, transport: Transport | None = None) -> WorkerContext:
        """Logging into <run dir>/logs/<id>.jsonl, tracing, and the transport (Kafka unless one is given)."""
        me = worker_id(role)
        log = configure_logging(run_dir(config) / "logs" / f"{me}.jsonl")
        return cls(config, role, me, log, configure_tracing(config, role), transport or kafka_transport(config))

    @property
    def run_dir(self) -> Path:
        return run_dir(self.config)

    def metrics(self) -> MetricsWriter:
        """This worker's lines in the run's metrics.jsonl."""
        return MetricsWriter(self.run_dir / "metrics.jsonl", self.role)
