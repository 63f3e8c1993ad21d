"""Commit discipline for workers that process many records at once.

A record's offset may be committed only once it and every record before it on
its partition are fully processed, so a restarted worker re-reads exactly what
was still in flight.
"""

from __future__ import annotations

from aiokafka import ConsumerRebalanceListener, TopicPartition


class CommitTracker:
    def __init__(self) -> None:
        self._in_flight: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}  # one past the highest offset seen
        self._committed: dict[TopicPartition, int] = {}

    def started(self, tp: TopicPartition, offset: int) -> None:
        self._in_flight.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def finished(self, tp: TopicPartition, offset: int) -> None:
        self._in_flight.get(tp, set()).discard(offset)  # a forgotten partition's records no longer count

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Drop partitions taken away by a rebalance: their records go to another worker."""
        for tp in partitions:
            self._in_flight.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)

    def rebalance_listener(self) -> ConsumerRebalanceListener:
        """For `make_group_consumer`: forget revoked partitions, so no commit is sent for them."""
        tracker = self

        class Forget(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked) -> None:
                tracker.forget(set(revoked))

            def on_partitions_assigned(self, assigned) -> None:
                pass

        return Forget()

    def to_commit(self) -> dict[TopicPartition, int]:
        """Per partition, the offset to commit now, where it moved since the last call."""
        offsets = {tp: min(self._in_flight.get(tp) or {end}) for tp, end in self._next.items()}
        changed = {tp: o for tp, o in offsets.items() if self._committed.get(tp) != o}
        self._committed.update(changed)
        return changed
