"""Scored trajectories -> complete groups -> batches, oldest first, exactly once.

Pure bookkeeping (no Kafka, no torch) so that the trainer's admission rules can be
tested alone: a trajectory id is accepted at most once, a group is trainable only
when all its samples are present, a group too stale to train (or refused at its
release) is dropped with a recorded reason, and a trajectory at odds with its
group's release or members is refused (`disagreement`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.messages import DroppedGroup, PromptGroup, Scored, prompt_id_of
from workers.staleness import admissible, staleness

Position = tuple[int, int]  # (partition, offset) of a record in `scored`
UNIFORM = "uniform"  # the reason of a group dropped for having no advantage begins so
FACTS = ("n_samples", "release_index", "released_at_version", "prompt_tokens")  # a release's, copied by each sample


def differing_fact(record: Scored | PromptGroup, reference: Scored | PromptGroup) -> str | None:
    return next((name for name in FACTS if getattr(record, name) != getattr(reference, name)), None)


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

    def uniform_reward(self) -> float | None:
        """The reward every sample got, if they all got the same one (the group has no advantage); else None."""
        rewards = {scored.reward for scored, _ in self.members.values()}
        return next(iter(rewards)) if len(rewards) == 1 else None


class GroupBuffer:
    def __init__(self, done_trajectories: set[str] = frozenset(), done_prompts: set[str] = frozenset()):
        self.seen: set[str] = set(done_trajectories)  # trajectory ids trained, dropped or buffered
        self.done_prompts: set[str] = set(done_prompts)  # groups trained or dropped
        self.groups: dict[str, Group] = {}
        self.outstanding: dict[str, PromptGroup] = {}  # released, not yet trained or dropped
        self.uniform_dropped = (0, 0)  # (trainer version, uniform groups dropped while at it)

    def note_release(self, release: PromptGroup) -> str | None:
        """A group the prompt source released: it must be trained by version released_at_version + eta, with
        its n_samples. Returns why a second, different release of the same group is refused (None if taken).

        Trajectories buffered before their release was read and at odds with it are let go (they were
        forged); their ids are forgotten so that the real ones still complete the group."""
        pid = release.prompt_id
        if pid in self.done_prompts:
            return None
        if (known := self.outstanding.get(pid)) is not None:
            name = differing_fact(release, known)
            return name and f"{name} differs from the release of {pid!r} already read"
        self.outstanding[pid] = release
        if (group := self.groups.pop(pid, None)) is not None:
            fresh = self._new_group(release)
            for index, (scored, where) in group.members.items():
                if differing_fact(scored, release) is None:
                    fresh.members[index] = (scored, where)
                else:
                    self.seen.discard(scored.trajectory_id)
            self.groups[pid] = fresh
        return None

    def disagreement(self, scored: Scored) -> str | None:
        """Why `scored` may not join its group (None if it may): a record at odds with its release (or, while
        the release is unread, with the trajectories already buffered) must not decide the group's size,
        order, staleness or prompt."""
        if scored.trajectory_id in self.seen:
            return None  # a copy: `add` ignores it
        if (release := self.outstanding.get(scored.prompt_id)) is not None:
            name = differing_fact(scored, release)
            return name and f"{name} {getattr(scored, name)} differs from its release's {getattr(release, name)}"
        group = self.groups.get(scored.prompt_id)
        if group is None or not group.members:
            return None
        first, _ = next(iter(group.members.values()))
        name = differing_fact(scored, first)
        return name and f"{name} differs from the {len(group.members)} trajectories buffered for its group"

    def add(self, scored: Scored, where: Position) -> bool:
        """Buffer one trajectory; False for a duplicate or a member of a finished group."""
        if scored.trajectory_id in self.seen or scored.prompt_id in self.done_prompts:
            return False
        self.seen.add(scored.trajectory_id)
        if (group := self.groups.get(scored.prompt_id)) is None:
            group = self.groups[scored.prompt_id] = self._new_group(self.outstanding.get(scored.prompt_id, scored))
        group.members[scored.sample_index] = (scored, where)
        return True

    def take(
        self, batch_groups: int, trainer_version: int, max_staleness: int, skip_uniform: int = 0
    ) -> tuple[list[Group], list[DroppedGroup]]:
        """`batch_groups` complete groups (oldest release first) and the groups dropped on the way.

        A released group whose last admissible version is this one (released at
        trainer_version - eta) must be in this batch: while one is still incomplete
        the trainer waits for it rather than step past its deadline, so stragglers
        (long answers) are trained, not dropped. Groups already past their deadline
        (possible only if their release was seen late, or it was released ahead of skips
        that did not come) are dropped with the reason,
        and so are, up to `skip_uniform` per version, complete groups whose samples all
        got the same reward. Returns an empty batch until the batch can be made.
        """
        released = {pid: g.released_at_version for pid, g in (self.groups | self.outstanding).items()}
        dropped = [
            self._drop(pid, v, trainer_version, max_staleness)
            for pid, v in sorted(released.items())
            if not admissible(trainer_version, v, max_staleness)
        ]
        version, count = self.uniform_dropped
        so_far = count if version == trainer_version else 0
        if skip_uniform > so_far:  # else no group is judged: the poll loop calls this often
            uniform = [g for g in self.groups.values() if g.complete and g.uniform_reward() is not None]
            uniform = sorted(uniform, key=lambda g: g.release_index)[: skip_uniform - so_far]
            self.uniform_dropped = (trainer_version, so_far + len(uniform))
            dropped += [self._drop_uniform(g) for g in uniform]
        if self.due_incomplete(trainer_version, max_staleness):
            return [], dropped
        ready = sorted((g for g in self.groups.values() if g.complete), key=lambda g: g.release_index)
        batch = ready[:batch_groups]
        if len(batch) < batch_groups:
            return [], dropped
        for group in batch:
            self.finish(group.prompt_id)
        return batch, dropped

    def due_incomplete(self, trainer_version: int, max_staleness: int) -> bool:
        """A released group whose last admissible version is this one is not complete yet: no batch until it is."""
        return any(
            staleness(trainer_version, release.released_at_version) == max_staleness
            and (pid not in self.groups or not self.groups[pid].complete)
            for pid, release in self.outstanding.items()
        )

    def held_by_straggler(self, batch_groups: int, trainer_version: int, max_staleness: int) -> bool:
        """A batch of complete groups is ready, but a group due now is not complete: the trainer waits for that
        group's straggler (its longest answer), not for generation as a whole."""
        ready = sum(group.complete for group in self.groups.values())
        return ready >= batch_groups and self.due_incomplete(trainer_version, max_staleness)

    def take_exact(self, trajectory_ids: list[str]) -> list[Group] | None:
        """The groups holding exactly these trajectories (a recorded manifest), in the manifest's
        order (the step's row order, so it is redone bit for bit), once all are buffered."""
        prompt_ids = list(dict.fromkeys(prompt_id_of(tid) for tid in trajectory_ids))
        groups = [self.groups.get(pid) for pid in prompt_ids]
        if any(g is None or not g.complete for g in groups):
            return None
        for pid in prompt_ids:
            self.finish(pid)
        return groups

    def finish(self, prompt_id: str) -> Group | None:
        self.done_prompts.add(prompt_id)
        self.outstanding.pop(prompt_id, None)
        return self.groups.pop(prompt_id, None)

    def oldest_positions(self) -> dict[int, int]:
        """Per partition, the smallest offset still buffered: where a restart must read from."""
        oldest: dict[int, int] = {}
        for group in self.groups.values():
            for _, (partition, offset) in group.members.values():
                oldest[partition] = min(offset, oldest.get(partition, offset))
        return oldest

    @staticmethod
    def _new_group(facts: Scored | PromptGroup) -> Group:
        return Group(facts.prompt_id, facts.n_samples, facts.release_index, facts.released_at_version)

    def _drop_uniform(self, group: Group) -> DroppedGroup:
        self.finish(group.prompt_id)
        reason = f"{UNIFORM}: all {group.n_samples} samples scored {group.uniform_reward():g} (no advantage)"
        return DroppedGroup(prompt_id=group.prompt_id, reason=reason)

    def _drop(self, prompt_id: str, released_at_version: int, trainer_version: int, max_staleness: int) -> DroppedGroup:
        self.finish(prompt_id)
        lag = staleness(trainer_version, released_at_version)
        return DroppedGroup(
            prompt_id=prompt_id,
            reason=f"stale: released at v{released_at_version}, trainer at v{trainer_version}, "
            f"staleness {lag} > max_staleness {max_staleness}",
        )
