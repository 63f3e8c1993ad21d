"""metrics.jsonl into a real, offline W&B run (no network here; W&B runs a service process of its own), read
back from the run's own log file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.monitor import WandbStream
from workers.runtime import MetricsWriter

BLOCK, CHUNK_HEADER, FULL, LAST = 32 * 1024, 7, 1, 4


def offline_records(run_dir: Path) -> list:
    """The records of the offline run's `.wandb` file: after a 7-byte ':W&B' header, LevelDB log
    format: 32 KiB blocks of chunks [crc32c 4][length 2, little-endian][type 1][data], a record
    split over chunks FIRST..MIDDLE..LAST when it crosses a block; a block's last < 7 bytes are padding."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, at = [], b"", CHUNK_HEADER
    while at + CHUNK_HEADER <= len(data):
        if BLOCK - at % BLOCK < CHUNK_HEADER:
            at += BLOCK - at % BLOCK
            continue
        length, kind = int.from_bytes(data[at + 4 : at + 6], "little"), data[at + 6]
        pending += data[at + CHUNK_HEADER : at + CHUNK_HEADER + length]
        at += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            records.append(Record.FromString(pending))
            pending = b""
    return records


def values(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_every_metrics_line_reaches_the_wandb_run_on_its_sources_step_axis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # telemetry.wandb_mode empty: the environment decides
    config = load_config(None, ["name=wandb-test", "telemetry.wandb_project=asyncrl-test"])
    trainer, evaluation, rollout = (
        MetricsWriter(tmp_path / "metrics.jsonl", s) for s in ("trainer", "eval", "rollout")
    )
    stream = WandbStream(config, tmp_path)
    trainer.write(step=1, reward_mean=0.25, staleness_histogram=[3, 1])
    trainer.write(step=2, reward_mean=0.5)
    stream.sync()
    trainer.write(step=2, reward_mean=0.75)  # a restarted trainer repeats the steps after its checkpoint
    evaluation.write(step=2, heldout_accuracy=0.4)
    rollout.write(step=2, worker="rollout-host-7", generated_tokens=640)
    stream.finish({"outcome": "finished", "final_accuracy": 0.4})

    records = offline_records(tmp_path)
    (run,) = [r.run for r in records if r.HasField("run")]
    assert (run.project, run.display_name) == ("asyncrl-test", "wandb-test")
    axes = {r.metric.glob_name: r.metric.step_metric for r in records if r.HasField("metric")}
    assert axes == {
        "trainer/*": "trainer/step",
        "eval/*": "eval/step",
        "rollout/rollout-host-7/*": "rollout/rollout-host-7/step",
    }
    logged = [
        {k: v for k, v in values(r.history.item).items() if not k.startswith("_")}
        for r in records
        if r.HasField("history")
    ]
    peaks = [line.pop(key) for line in logged for key in list(line) if key.endswith("/peak_rss_mb")]
    assert len(peaks) == 5 and all(peak > 0 for peak in peaks)  # each line's process's peak memory, MB
    assert logged == [
        {"trainer/step": 1, "trainer/reward_mean": 0.25},  # the histogram (a list) and the time are left out
        {"trainer/step": 2, "trainer/reward_mean": 0.5},
        {"trainer/step": 2, "trainer/reward_mean": 0.75},
        {"eval/step": 2, "eval/heldout_accuracy": 0.4},
        {"rollout/rollout-host-7/step": 2, "rollout/rollout-host-7/generated_tokens": 640},
    ]
    summary: dict = {}
    for record in (r for r in records if r.HasField("summary")):
        summary |= values(record.summary.update)
    assert summary["outcome"] == "finished" and summary["final_accuracy"] == 0.4
    (exit_record,) = [r.exit for r in records if r.HasField("exit")]
    assert exit_record.exit_code == 0
