"""The launcher starts its workers on standby (`asyncrl worker ROLE --standby`) before config.yaml exists: a worker
imports its code, then reads its config only once it is told `go`; a launcher that ends first ends it quietly,
and one whose preparation fails stops every worker it started."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from pipeline import launch
from pipeline.config import ConfigError, resolve
from pipeline.launch import LocalRun, StopSignals, WorkerProcess
from schemas.config import RunConfig


def waiting_on_stdin(worker: WorkerProcess, timeout_s: float = 60.0) -> bool:
    """True once the worker sleeps reading its stdin pipe (its imports are done); False if it ended first."""
    deadline = time.monotonic() + timeout_s
    while worker.process.poll() is None and time.monotonic() < deadline:
        if "pipe" in Path(f"/proc/{worker.process.pid}/wchan").read_text():
            return True
        time.sleep(0.05)
    return False


def test_a_worker_on_standby_never_reads_its_config_when_the_launcher_ends_first(tmp_path: Path) -> None:
    config, log = tmp_path / "config.yaml", tmp_path / "reward-1.stdout"  # no config.yaml, as before `prepare`
    worker = WorkerProcess("reward", 1, config, log)
    worker.start(standby=True)
    assert worker.awaiting_go and waiting_on_stdin(worker)  # imported, and alive without a config
    worker.process.stdin.close()  # what the launcher's end does to the pipe
    assert worker.process.wait(timeout=60) == 0
    assert "asyncrl:" not in log.read_text() and "Traceback" not in log.read_text()


def test_a_worker_on_standby_reads_its_config_once_told_go(tmp_path: Path) -> None:
    config, log = tmp_path / "config.yaml", tmp_path / "reward-1.stdout"
    worker = WorkerProcess("reward", 1, config, log)
    worker.start(standby=True)
    assert waiting_on_stdin(worker)  # a worker that read its config first would have ended: there is none
    config.write_text("trainer:\n  steps: many\n")
    worker.go()
    worker.go()  # a second go (or one to a worker not on standby) changes nothing
    assert worker.process.wait(timeout=60) == 2
    assert "trainer.steps" in log.read_text() and str(config) in log.read_text()


def test_a_failed_preparation_stops_the_workers_on_standby(tmp_path: Path, monkeypatch) -> None:
    """A config error found while preparing (after the workers started importing) stops and reaps every one."""

    def failing_prepare(config: RunConfig, progress: bool):
        raise ConfigError("data.reward: no such function")

    monkeypatch.setattr(launch, "prepare", failing_prepare)
    config = resolve(msgspec.convert({"runs_dir": str(tmp_path), "broker": {"bootstrap": "127.0.0.1:9"}}, RunConfig))
    (tmp_path / "run").mkdir()
    run = LocalRun(msgspec.structs.replace(config, name="run"), tmp_path / "run")
    with StopSignals() as stops, pytest.raises(ConfigError):
        try:
            run.start(stops, eval_rows=None, progress=False)
        finally:
            run.stop()
    assert [w.role for w in run.workers] == ["trainer", "reward", "prompts", "rollout"]
    assert all(w.process.poll() is not None and not w.awaiting_go for w in run.workers)


def test_the_launcher_reaches_its_workers_start_without_torch() -> None:
    """What `run_locally` imports before the workers are on standby (a raw template: a chat template's check
    loads the tokenizer): with torch among them, the launcher's imports would come before its workers'."""
    modules = ("pipeline.launch", "pipeline.monitor", "pipeline.eval_set", "pipeline.eval_worker", "workers.rows")
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"
