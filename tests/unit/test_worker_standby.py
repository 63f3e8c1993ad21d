"""The launcher starts its workers on standby (`asyncrl worker ROLE --standby`) before config.yaml exists: a worker
imports its code, then reads its config only once it is told `go`; a launcher that ends first ends it quietly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.launch import WorkerProcess


def test_a_worker_on_standby_never_reads_its_config_when_the_launcher_ends_first(tmp_path: Path) -> None:
    config, log = tmp_path / "config.yaml", tmp_path / "reward-1.stdout"  # no config.yaml, as before `prepare`
    worker = WorkerProcess("reward", 1, config, log)
    worker.start(standby=True)
    assert worker.on_standby
    worker.process.stdin.close()  # what the launcher's end does to the pipe
    assert worker.process.wait(timeout=60) == 0
    assert log.read_text() == ""  # read no config: a missing one would have been an error
    assert not worker.on_standby


def test_a_worker_on_standby_reads_its_config_once_told_go(tmp_path: Path) -> None:
    config, log = tmp_path / "config.yaml", tmp_path / "reward-1.stdout"
    worker = WorkerProcess("reward", 1, config, log)
    worker.start(standby=True)
    config.write_text("trainer:\n  steps: many\n")  # written while it imports; it must be read after `go`
    worker.go()
    assert worker.process.wait(timeout=60) == 2
    assert "trainer.steps" in log.read_text() and str(config) in log.read_text()
    assert not worker.on_standby


def test_the_launcher_reaches_its_workers_start_without_torch() -> None:
    """What `run_locally` imports before the workers are on standby: with torch among them, the launcher's ~4
    CPU-seconds of imports would come before its workers' instead of beside them."""
    modules = ("pipeline.launch", "pipeline.monitor", "pipeline.eval_set", "pipeline.eval_worker", "workers.rows")
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"
