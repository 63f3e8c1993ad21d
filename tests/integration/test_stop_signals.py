"""A stop signal raises RunStopped in the launcher's main thread wherever it is, except inside a worker's start:
raised inside Popen it would leave a process running that the launcher has not recorded, so never stops (CI has
caught it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from pipeline.launch import worker_processes
from pipeline.launch.stop_signals import RunStopped, StopSignals
from pipeline.launch.worker_processes import WorkerProcess

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_stop_signal_raises_at_once_outside_a_worker_start() -> None:
    with StopSignals(), pytest.raises(RunStopped) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between two bytecodes of this thread
            pass
    assert stopped.value.exit_code == 128 + signal.SIGTERM and stopped.value.reason == "SIGTERM received"


def signal_inside_popen(monkeypatch, signum: int) -> list[int]:
    """Popen starts a sleeper, then the launcher gets `signum` before Popen's caller has what it returns."""
    real, started = subprocess.Popen, []

    def popen(args, **kwargs):
        process = real(SLEEPER, **kwargs)
        os.kill(os.getpid(), signum)
        for _ in range(1000):  # bytecodes, between which the handler runs
            pass
        started.append(process.pid)
        return process

    monkeypatch.setattr(worker_processes.subprocess, "Popen", popen)
    return started


def test_a_stop_during_a_worker_start_is_raised_once_its_process_is_recorded(tmp_path, monkeypatch) -> None:
    started = signal_inside_popen(monkeypatch, signal.SIGINT)
    worker = WorkerProcess("prompts", 0, tmp_path / "config.yaml", tmp_path / "prompts-0.stdout")
    try:
        with StopSignals() as stops, pytest.raises(RunStopped) as stopped:
            worker.start()
        assert started and worker.process is not None and worker.process.pid == started[0]
        assert worker.process.poll() is None  # running, and the launcher knows it: its cleanup stops it
        assert stopped.value.exit_code == 128 + signal.SIGINT and stops.stopped is stopped.value
        assert not stops.holding and not stops.deferred and StopSignals.active is None
        worker.stop(timeout_s=5)
        assert worker.process.returncode == -signal.SIGTERM
    finally:  # unrecorded when held() is broken: the sleeper goes anyway
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_stop_during_the_cleanup_s_start_only_says_so(tmp_path, monkeypatch, capfd) -> None:
    """finish_evaluation starts the evaluator after the first Ctrl-C: a second one must not cut that start."""
    started = signal_inside_popen(monkeypatch, signal.SIGINT)
    worker = WorkerProcess("eval", 0, tmp_path / "config.yaml", tmp_path / "eval-0.stdout", idle=True)
    with StopSignals() as stops:
        stops.stopped, stops.cleaning = RunStopped("stopped", "SIGINT received", 130), True
        worker.start()  # the evaluator started for the final evaluation, after the first Ctrl-C: nothing raised
    assert started and worker.process.pid == started[0]
    worker.stop(timeout_s=5)
    assert "asyncrl: already stopping" in capfd.readouterr().err
