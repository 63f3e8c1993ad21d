"""The trainer's side of a resumable run on the embedded broker: a checkpoint is written only once the topics
it names are exported; when the broker cannot be read the trainer goes on without that checkpoint."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import msgspec

from schemas.config import LauncherState
from schemas.messages import BatchManifest
from tests.factories import scored
from tests.unit.workers.test_worker_loops import config_for, publish, released
from topics.memory import MemoryTransport
from topics.names import TopicLayout
from workers import runtime
from workers.trainer import worker as trainer_worker
from workers.trainer.model import checkpoints_dir


async def test_a_checkpoint_whose_topics_cannot_be_exported_is_skipped(tmp_path: Path, demo_model_dir: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on: the embedded broker is gone
        probe.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{probe.getsockname()[1]}"
    settings = ("trainer.batch_groups=1", "trainer.steps=2", "trainer.checkpoint.every=1")
    config = config_for(tmp_path, demo_model_dir, *settings, f"broker.bootstrap={gone}")
    config = msgspec.structs.replace(config, launcher=LauncherState(embedded_broker=True))
    transport, groups = MemoryTransport(TopicLayout()), [released(n, 0) for n in range(2)]
    await publish(transport, *groups, *(scored(group=g, sample=i, reward=float(i)) for g in groups for i in (0, 1)))
    await asyncio.wait_for(trainer_worker.main(config, asyncio.Event(), transport), 60)
    assert [m.step for m in transport.broker.messages("batches", BatchManifest)] == [1, 2]  # it trained on
    assert list(checkpoints_dir(config).glob("step_*.pt")) == []
    assert not runtime.topics_export_path(config).exists()  # no file rather than an empty one
    logs = [json.loads(line) for path in (runtime.run_dir(config) / "logs").glob("trainer-*.jsonl")
            for line in path.read_text().splitlines() if line.startswith("{")]  # fmt: skip
    skipped = [line for line in logs if line["event"] == "checkpoint skipped: topics not exported"]
    assert [line["step"] for line in skipped] == [1, 2] and all(gone in line["error"] for line in skipped)
