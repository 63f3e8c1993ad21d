"""Topic names and per-topic settings of one run.

Code names a topic by its role ("prompts"); the broker sees the role behind an
optional prefix (config `broker.topic_prefix`), so several runs can share one
broker. The prefix is used verbatim: "run7." gives "run7.prompts".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schemas.messages import TOPIC_MESSAGE, Message

PROMPTS = "prompts"
SEGMENTS = "segments"
SCORED = "scored"
WEIGHTS = "weights"
BATCHES = "batches"
DEAD_LETTER = "dead-letter"

ROLES: tuple[str, ...] = (PROMPTS, SEGMENTS, SCORED, WEIGHTS, BATCHES, DEAD_LETTER)

# Consumer groups (named after the prefix) and the role each reads; an export keeps their committed offsets.
ROLLOUT_GROUP, REWARD_GROUP = "rollout", "reward"
CONSUMER_GROUPS = {ROLLOUT_GROUP: PROMPTS, REWARD_GROUP: SEGMENTS}

# Every reader of `weights` must see the versions in the order they were made.
_SINGLE_PARTITION_ROLES = frozenset({WEIGHTS})


@dataclass(frozen=True)
class TopicSpec:
    role: str  # the name code uses, e.g. "prompts"
    name: str  # the name on the broker, prefix applied
    partitions: int
    message: type[Message]  # what every record's value decodes to


class TopicLayout:
    """The six topics of one run: names on the broker, partition counts, message types."""

    def __init__(self, prefix: str = "", partitions: int | Mapping[str, int] = 1) -> None:
        """`partitions`: one count for every role but `weights`, or a count per role
        (roles left out get 1). `weights` always has exactly one partition."""
        counts = _partition_counts(partitions)
        self.prefix = prefix
        self._specs = {role: TopicSpec(role, prefix + role, counts[role], TOPIC_MESSAGE[role]) for role in ROLES}

    def name(self, role: str) -> str:
        return self.spec(role).name

    def spec(self, role: str) -> TopicSpec:
        try:
            return self._specs[role]
        except KeyError:
            raise ValueError(f"unknown topic role {role!r}; roles are {ROLES}") from None

    @property
    def specs(self) -> tuple[TopicSpec, ...]:
        return tuple(self._specs.values())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self._specs.values())

    @property
    def partitions(self) -> dict[str, int]:
        """Partition count by broker topic name, as `ensure_topics` takes it."""
        return {spec.name: spec.partitions for spec in self._specs.values()}

    def role_of(self, name: str) -> str | None:
        """The role behind a broker topic name, or None if it is not one of this run's."""
        return next((spec.role for spec in self._specs.values() if spec.name == name), None)


def _partition_counts(partitions: int | Mapping[str, int]) -> dict[str, int]:
    if isinstance(partitions, int):
        counts = {role: 1 if role in _SINGLE_PARTITION_ROLES else partitions for role in ROLES}
    else:
        unknown = set(partitions) - set(ROLES)
        if unknown:
            raise ValueError(f"partitions given for unknown topic roles {sorted(unknown)}")
        counts = {role: partitions.get(role, 1) for role in ROLES}
    for role, count in counts.items():
        if count < 1:
            raise ValueError(f"topic {role!r} needs at least one partition, got {count}")
        if role in _SINGLE_PARTITION_ROLES and count != 1:
            raise ValueError(f"topic {role!r} must have exactly one partition, got {count}")
    return counts
