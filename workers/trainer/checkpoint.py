"""Trainer checkpoints: model, optimizer, RNG, counters, where to resume reading, what is done.

One format for any number of ranks: the full (unsharded) model and optimizer
state keyed by parameter name, written by rank 0, so a run may resume on a
different number of trainer ranks. Every rank must call `save` and `load_latest`
(with FSDP2 they gather or scatter the shards).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done == current weight version
    resume_offsets: dict[int, int] = field(default_factory=dict)  # `scored` partition -> first offset to re-read
    done_prompts: list[str] = field(default_factory=list)  # groups trained or dropped: never taken again
    pending_drops: list[tuple[str, str]] = field(default_factory=list)  # (prompt id, reason): no manifest has them yet
    groups_consumed: int = 0
    groups_dropped: int = 0  # dropped groups recorded in manifests (pending_drops not yet)
    groups_skipped: int = 0  # of those, the ones dropped for having no advantage
    trained_tokens: int = 0
    trained_trajectories: int = 0
    interrupted_trajectories: int = 0
    truncated_trajectories: int = 0  # cut at rollout.max_new_tokens (or the model's length): finish reason `length`
    mixed_version_trajectories: int = 0
    max_staleness_trained: int = 0
    skipped_steps: int = 0  # steps with an update not applied (NaN or inf loss or gradient norm); versions go on


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save(
    directory: Path, state: TrainerState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, keep: int = 2
) -> Path:
    """Write `step_<N>.pt` atomically (rank 0) and keep the newest `keep`. A collective under FSDP2. Frozen parameters
    (a LoRA run's base model) are left out: a restart loads them from model.path as the first start did."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    model_state = {name: t for name, t in model_state.items() if name not in frozen}  # a tied alias of one, too
    final = directory / f"step_{state.step:06d}.pt"
    if not _is_writer():
        return final
    directory.mkdir(parents=True, exist_ok=True)
    partial = final.with_suffix(".partial")
    rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save({"state": asdict(state), "model": model_state, "optimizer": optimizer_state, "rng": rng}, partial)
    os.replace(partial, final)
    for old in sorted(directory.glob("step_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def newest(directory: Path, before: int | None = None) -> Path | None:
    """The newest checkpoint (of a step < `before` if given), or None."""
    found = [p for p in sorted(directory.glob("step_*.pt")) if before is None or int(p.stem[5:]) < before]
    return found[-1] if found else None


def load(path: Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore `path` into model, optimizer and the RNG; a fresh state for None. A collective under FSDP2:
    rank 0 reads the file and the shards are sent from it; every rank gets the same RNG state."""
    if path is None:
        return TrainerState()
    distributed = dist.is_initialized()
    saved = torch.load(path, weights_only=False) if _is_writer() else {"model": {}, "optimizer": {}}
    frozen = any(not p.requires_grad for p in model.parameters())  # LoRA: the base is not in the checkpoint
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed, strict=not frozen)
    # two calls: `set_state_dict` takes an empty model dict (the other ranks') for "optimizer only"
    set_model_state_dict(model, saved["model"], options=options)
    set_optimizer_state_dict(model, optimizer, saved["optimizer"], options=options)
    if distributed:
        box = [{key: saved[key] for key in ("state", "rng")} if _is_writer() else None]
        dist.broadcast_object_list(box, src=0)
        saved = box[0]
    torch.set_rng_state(saved["rng"]["torch"])
    if saved["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
    state = TrainerState(**saved["state"])
    state.resume_offsets = {int(p): o for p, o in state.resume_offsets.items()}
    return state
