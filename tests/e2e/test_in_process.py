"""`asyncrl run --in-process`: every role's loop in one process on the in-memory transport, writing the run
directory `asyncrl run` writes; a stop signal ends it as it ends the launcher."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from msgspec.structs import replace

from pipeline.config import ConfigError, load_config
from pipeline.in_process import one_process
from workers.cores import cores_here

pytestmark = pytest.mark.e2e

STEPS, GROUPS, SAMPLES = 3, 2, 4
SMALL_RUN = [  # the demo task, untrained (no warm-up), short completions, every group trained
    f"trainer.batch_groups={GROUPS}",
    f"data.n_samples={SAMPLES}",
    "model.warmup_steps=0",
    "rollout.max_new_tokens=20",
    "trainer.skip_uniform_groups=0",
]


def in_process(tmp_path: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "run", "--in-process", "--no-progress", *SMALL_RUN,
            f"runs_dir={tmp_path / 'runs'}", *overrides]  # fmt: skip


def test_in_process_run_trains_publishes_and_writes_the_launchers_run_directory(tmp_path):
    started = time.monotonic()
    done = subprocess.run(
        in_process(tmp_path, f"trainer.steps={STEPS}", "telemetry.sample_ratio=1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = (tmp_path / "runs" / "latest").resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["outcome"], summary["steps"]) == ("finished", STEPS)
    assert summary["trained_trajectories"] == STEPS * GROUPS * SAMPLES and summary["exported_model"]
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == [f"v{v:06d}.safetensors" for v in range(4)]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line["source"] == "trainer"] == [1, 2, 3]
    assert max(line["scored"] for line in lines if line["source"] == "reward") >= STEPS * GROUPS * SAMPLES
    spans = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    trained = {s["context"]["trace_id"] for s in spans if s["name"] == "train group"}
    services = {s["resource"]["attributes"]["service.name"] for s in spans if s["context"]["trace_id"] in trained}
    assert services == {"asyncrl-prompts", "asyncrl-rollout", "asyncrl-reward", "asyncrl-trainer"}  # one trace each
    logs = {path.name.split("-")[0]: path.read_text() for path in (run_dir / "logs").glob("*.jsonl")}
    assert '"rollout started"' in logs["rollout"] and '"rollout started"' not in logs["trainer"]  # each its own
    assert '"weights loaded"' in logs["rollout"]  # a version the trainer published, in the rollout's engine
    assert time.monotonic() - started < 120


def test_in_process_run_stops_cleanly_on_ctrl_c(tmp_path):
    with open(tmp_path / "stderr", "wb") as stderr:
        process = subprocess.Popen(in_process(tmp_path, "trainer.steps=1000"), stdout=subprocess.PIPE, stderr=stderr)
        metrics = tmp_path / "runs" / "latest" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"source": "trainer"' in metrics.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, (tmp_path / "stderr").read_text()[-3000:]
    summary = json.loads(out)
    assert (summary["outcome"], summary["reason"]) == ("stopped", "SIGINT received") and 0 < summary["steps"] < 1000


def test_in_process_run_refuses_more_than_one_worker_per_role_and_shares_the_cores():
    config = load_config(None, ["broker.bootstrap=localhost:9092", "broker.partitions=2"])
    with pytest.raises(ConfigError, match="--in-process runs one worker per role"):
        one_process(replace(config, rollout=replace(config.rollout, workers=2)))
    alone = one_process(config)
    assert alone.broker.bootstrap == "" and not alone.eval.enabled  # no broker, no evaluator process
    assert alone.trainer.threads == alone.rollout.threads == max(1, cores_here() // 2)
