"""Scored trajectories -> complete groups -> batches, oldest first, exactly once.

Pure bookkeeping (no Kafka, no torch) so that the trainer's admission rules can be
tested alone: a trajectory id is accepted at most once, a group is trainable only
when all its samples are present, and a group too stale to train is dropped with
a recorded reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.messages import DroppedGroup, Scored
from workers.staleness import admissible, staleness

Position = tuple[int, int]  # (partition, offset) of a record in `scored`


@dataclass
class Group:
    prompt_id: str
    n_samples: int
    release_index: int
    released_at_version: int
    members: dict[int, tuple[Scored, Position]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.members) == self.n_samples

    def trajectories(self) -> list[tuple[Scored, Position]]:
        return [self.members[i] for i in sorted(self.members)]


class GroupBuffer:
    def __init__(self, done_trajectories: set[str] = frozenset(), done_prompts: set[str] = frozenset()):
        self.seen: set[str] = set(done_trajectories)  # trajectory ids trained, dropped or buffered
        self.done_prompts: set[str] = set(done_prompts)  # groups trained or dropped
        self.groups: dict[str, Group] = {}

    def add(self, scored: Scored, where: Position) -> bool:
        """Buffer one trajectory; False for a duplicate or a member of a finished group."""
        if scored.trajectory_id in self.seen or scored.prompt_id in self.done_prompts:
            return False
        self.seen.add(scored.trajectory_id)
        group = self.groups.setdefault(
            scored.prompt_id,
            Group(scored.prompt_id, scored.n_samples, scored.release_index, scored.released_at_version),
        )
        group.members[scored.sample_index] = (scored, where)
        return True

    def take(self, batch_groups: int, trainer_version: int, max_staleness: int) -> tuple[list[Group], list[DroppedGroup]]:
        """Up to `batch_groups` complete groups (oldest release first) and the groups dropped on the way.

        Returns an empty batch until `batch_groups` admissible groups are complete;
        dropped groups are removed at once either way.
        """
        ready = sorted((g for g in self.groups.values() if g.complete), key=lambda g: g.release_index)
        dropped = [self._drop(g, trainer_version, max_staleness) for g in ready if not admissible(trainer_version, g.released_at_version, max_staleness)]
        batch = [g for g in ready if g.prompt_id in self.groups][:batch_groups]
        if len(batch) < batch_groups:
            return [], dropped
        for group in batch:
            self.finish(group.prompt_id)
        return batch, dropped

    def take_exact(self, trajectory_ids: list[str]) -> list[Group] | None:
        """The groups holding exactly these trajectories (a recorded manifest), once all are buffered."""
        prompt_ids = sorted({tid.rsplit("/", 1)[0] for tid in trajectory_ids})
        groups = [self.groups.get(pid) for pid in prompt_ids]
        if any(g is None or not g.complete for g in groups):
            return None
        for pid in prompt_ids:
            self.finish(pid)
        return groups

    def finish(self, prompt_id: str) -> Group:
        self.done_prompts.add(prompt_id)
        return self.groups.pop(prompt_id)

    def oldest_positions(self) -> dict[int, int]:
        """Per partition, the smallest offset still buffered: where a restart must read from."""
        oldest: dict[int, int] = {}
        for group in self.groups.values():
            for _, (partition, offset) in group.members.values():
                oldest[partition] = min(offset, oldest.get(partition, offset))
        return oldest

    def _drop(self, group: Group, trainer_version: int, max_staleness: int) -> DroppedGroup:
        self.finish(group.prompt_id)
        lag = staleness(trainer_version, group.released_at_version)
        return DroppedGroup(
            prompt_id=group.prompt_id,
            reason=f"stale: released at v{group.released_at_version}, trainer at v{trainer_version}, "
            f"staleness {lag} > max_staleness {max_staleness}",
        )
