"""Trainer checkpoints: model, optimizer, RNG, step, counters and where to resume reading."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done == current weight version
    resume_offsets: dict[int, int] = field(default_factory=dict)  # `scored` partition -> first offset to re-read
    groups_consumed: int = 0
    groups_dropped: int = 0
    trained_tokens: int = 0
    interrupted_trajectories: int = 0
    mixed_version_trajectories: int = 0
    max_staleness_trained: int = 0


def save(directory: Path, state: TrainerState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, keep: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step_{state.step:06d}.pt"
    partial = final.with_suffix(".partial")
    torch.save(
        {"state": asdict(state), "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()},
        partial,
    )
    os.replace(partial, final)
    for old in sorted(directory.glob("step_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load_latest(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore the newest checkpoint into model and optimizer; a fresh state if there is none."""
    checkpoints = sorted(directory.glob("step_*.pt"))
    if not checkpoints:
        return TrainerState()
    saved = torch.load(checkpoints[-1], weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    state = TrainerState(**saved["state"])
    state.resume_offsets = {int(p): o for p, o in state.resume_offsets.items()}
    return state
