"""How `asyncrl run` stops: SIGINT, SIGTERM and the embedded broker's death become one exception, raised in the
launcher's main thread wherever it is, never inside the start of a process."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from collections.abc import Iterator

    from topics.broker import EmbeddedBroker


class RunStopped(KeyboardInterrupt):
    """Raised in the launcher's main thread wherever it is (the warm-up included; a process being started:
    once it is recorded, `StopSignals.held`) by a stop signal or the embedded broker's death, so that the run
    ends through the same cleanup as any other, without a traceback."""

    def __init__(self, outcome: str, reason: str, exit_code: int):
        super().__init__(reason)
        self.outcome, self.reason, self.exit_code = outcome, reason, exit_code


class StopSignals:
    """SIGINT and SIGTERM while `asyncrl run` runs: the first one raises RunStopped (exit code 128 + N; inside
    `held`, at the block's end). Once the cleanup has begun (`cleaning`) a signal only says so: a second Ctrl-C
    never cuts short the workers' checkpoint, the summary or the topic export. `watch` makes the broker's death
    a RunStopped too."""

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # SIGUSR1: sent by `watch`, the broker is gone
    active: ClassVar[StopSignals | None] = None  # the handlers installed now (`held` defers them)

    def __init__(self) -> None:
        self.cleaning, self.stopped, self.broker_gone, self.watcher = False, None, "", None
        self.holding, self.deferred = False, False

    def __enter__(self) -> StopSignals:
        self.previous = {signum: signal.signal(signum, self.handle) for signum in self.HANDLED}
        StopSignals.active = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        StopSignals.active = None
        if self.watcher is not None:  # ends with the broker, which the cleanup stopped: no SIGUSR1 after this
            self.watcher.join(timeout=1)
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def handle(self, signum: int, frame: object) -> None:
        if self.cleaning or self.stopped:  # os.write: print() may be mid-write in the interrupted code
            os.write(2, b"asyncrl: already stopping; waiting for the checkpoint, the summary and the topic export\n")
            return
        if signum == signal.SIGUSR1:
            self.stopped = RunStopped("failed", self.broker_gone, 1)
        else:
            self.stopped = RunStopped("stopped", f"{signal.Signals(signum).name} received", 128 + signum)
        if self.holding:
            self.deferred = True
            return
        raise self.stopped

    @classmethod
    def due(cls) -> bool:
        """A stop arrived inside `held` and waits for the block's end."""
        return cls.active is not None and cls.active.deferred

    @classmethod
    @contextlib.contextmanager
    def held(cls) -> Iterator[None]:
        """A stop that arrives inside the block is raised at its end. Raised inside Popen, it left the process
        started but unrecorded (`WorkerProcess.process` None): never stopped, and the cleanup failed on it."""
        stops = cls.active
        if stops is None or stops.holding:
            yield
            return
        stops.holding = True
        try:
            yield
        finally:
            stops.holding = False
            deferred, stops.deferred = stops.deferred, False
        if deferred:
            raise stops.stopped

    def watch(self, broker: EmbeddedBroker) -> None:
        """A thread that sends the main thread SIGUSR1 when the broker exits before the cleanup stops it."""

        def follow_broker() -> None:
            while broker.running:
                time.sleep(0.2)
            if not self.cleaning:
                tail = " | ".join(line for line in broker.log_tail().splitlines()[-3:] if line.strip())
                self.broker_gone = (
                    f"the embedded broker exited with code {broker.exit_code} ({broker.log_path}: {tail})"
                )
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

        self.watcher = threading.Thread(target=follow_broker, name="broker-watch", daemon=True)
        self.watcher.start()
