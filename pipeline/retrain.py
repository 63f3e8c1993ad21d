"""`asyncrl replay retrain --step N`: train step N again from the record, compare with its weights.

The record of step N is its manifest on `batches` (exactly which trajectories,
at which `scored` offsets) and the newest checkpoint before it (or the initial
weights at model.path). Steps between that checkpoint and N are rebuilt from
their manifests too. The result is compared with what the run kept of version N:
its weights file (a delta version rebuilt from its chain), else a checkpoint at step N.
On CPU in one process it is equal bit for bit; a run trained on several ranks reduces
in another order (~1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.monitor import read_metrics
from schemas.config import RunConfig
from schemas.messages import BatchManifest, Scored
from schemas.validate import DecodeError, decode
from topics.inspect import RawRecord
from workers import lora, runtime
from workers.trainer import checkpoint
from workers.trainer.buffer import GroupBuffer
from workers.trainer.model import Trainer, checkpoints_dir
from workers.weight_deltas import read_stored_version
from workers.weights import WeightsError


class RetrainError(LookupError):
    """The record lacks what retraining the step needs."""


@dataclass
class Retrained:
    step: int
    from_step: int  # the checkpoint's step; 0 = the initial weights
    trajectories: int  # in step N
    stats: dict[str, float]  # step N's training stats
    compared_with: str  # the file of version N it was compared with
    max_abs_diff: dict[str, float]  # per tensor

    @property
    def bitwise_equal(self) -> bool:
        return all(diff == 0.0 for diff in self.max_abs_diff.values())


def groups_of(manifest: BatchManifest, scored: dict[tuple[int, int], Scored]) -> list:
    """The groups of a recorded step, rows in the manifest's order."""
    buffer = GroupBuffer()
    for where in manifest.scored_offsets:
        if tuple(where) not in scored:
            raise RetrainError(f"step {manifest.step}: `scored` has no record at partition/offset {tuple(where)}")
        buffer.add(scored[tuple(where)], tuple(where))
    groups = buffer.take_exact(manifest.trajectory_ids)
    if groups is None:
        raise RetrainError(f"step {manifest.step}: its trajectories do not make whole groups in `scored`")
    return groups


def recorded_weights(config: RunConfig, step: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """Version `step` as the run kept it: the published weights (whole or delta), else a checkpoint of that step.
    RetrainError when neither is there, or the published version's file (or a delta of its chain) is corrupt."""
    directory = runtime.weights_dir(config)
    path = runtime.stored_path(directory, step)
    if path.exists():
        try:
            return path, read_stored_version(directory, step).tensors
        except WeightsError as error:
            raise RetrainError(str(error)) from None
    saved = checkpoints_dir(config) / f"step_{step:06d}.pt"
    if saved.exists():
        model = torch.load(saved, weights_only=False)["model"]
        return saved, lora.published_names(model) if lora.enabled(config.model.lora) else model
    raise RetrainError(
        f"version {step} is no longer on disk (neither {path} nor {saved}): "
        "raise trainer.checkpoint.keep_versions or trainer.checkpoint.keep to keep more"
    )


def step_threads(config: RunConfig) -> dict[int, int]:
    """The threads each step ran on (metrics.jsonl: trainer.threads as resolved where the run ran)."""
    lines, _ = read_metrics(runtime.run_dir(config) / "metrics.jsonl")
    return {line["step"]: line["threads"] for line in lines if line["source"] == "trainer" and "threads" in line}


def retrain(
    config: RunConfig, step: int, manifests: list[BatchManifest], scored: dict[tuple[int, int], Scored]
) -> Retrained:
    by_step = {m.step: m for m in manifests}
    if step not in by_step:
        recorded = f"steps {min(by_step, default=0)}..{max(by_step, default=0)}"
        raise RetrainError(f"no manifest of step {step} on `batches` ({recorded})")
    start = checkpoint.newest(checkpoints_dir(config), before=step)
    compared_with, expected = recorded_weights(config, step)
    threads = step_threads(config)
    trainer = Trainer(config, start)
    first = trainer.state.step + 1
    missing = [s for s in range(first, step + 1) if s not in by_step]
    if missing:
        raise RetrainError(f"steps {missing} have no manifest: cannot rebuild from step {first - 1}")
    for s in range(first, step + 1):
        torch.set_num_threads(threads.get(s, config.trainer.threads or 1))  # the thread count orders the sums
        stats = trainer.train(groups_of(by_step[s], scored))
    weights = trainer.commands.gather_weights()  # float32 masters; a version file holds them cast to model.dtype
    diffs = {
        name: (weights[name].to(tensor.dtype).float() - tensor.float()).abs().max().item()
        for name, tensor in expected.items()
        if name in weights
    }
    return Retrained(step, first - 1, len(by_step[step].trajectory_ids), stats, str(compared_with), diffs)


def render(result: Retrained) -> str:
    worst = max(result.max_abs_diff.items(), key=lambda item: item[1])
    verdict = "bitwise equal" if result.bitwise_equal else f"max |difference| {worst[1]:.3g} (in {worst[0]})"
    first = result.from_step + 1
    rebuilt = f"steps {first}..{result.step}" if first < result.step else f"step {result.step}"
    start = f"checkpoint of step {result.from_step}" if result.from_step else "the initial weights"
    return "\n".join(
        [
            f"step {result.step}: {result.trajectories} trajectories; {rebuilt} retrained from {start}",
            f"loss {result.stats['loss']:.6g}  reward mean {result.stats['reward_mean']:.4g}  "
            f"grad norm {result.stats['grad_norm']:.6g}",
            f"weights vs {result.compared_with}: {verdict} over {len(result.max_abs_diff)} tensors",
        ]
    )


def load_record(
    batches: list[RawRecord], scored: list[RawRecord]
) -> tuple[list[BatchManifest], dict[tuple[int, int], Scored]]:
    """Manifests and scored trajectories from raw records (of a broker or an export); records that
    do not decode were dead-lettered by the trainer and never trained, so they are left out."""

    def decoded(records: list[RawRecord], cls):
        for record in records:
            try:
                yield record, decode(record.value or b"", cls)
            except DecodeError:
                continue

    manifests = [message for _, message in decoded(batches, BatchManifest)]
    return manifests, {(r.partition, r.offset): message for r, message in decoded(scored, Scored)}
