from aiokafka import TopicPartition

from topics.kafka import ForgetRevoked
from topics.transport import CommitTracker

P = 0  # one partition of `prompts`


def test_commits_only_up_to_the_oldest_record_in_flight():
    tracker = CommitTracker()
    for offset in (5, 6, 7):
        tracker.started(P, offset)
    tracker.finished(P, 6)
    assert tracker.to_commit() == {P: 5}  # 5 still in flight: a restart re-reads 5, 6, 7
    tracker.finished(P, 5)
    assert tracker.to_commit() == {P: 7}
    assert tracker.to_commit() == {}  # nothing moved
    tracker.finished(P, 7)
    assert tracker.to_commit() == {P: 8}


def test_revoked_partitions_are_forgotten_and_not_committed():
    tracker = CommitTracker()
    tracker.started(P, 0)
    tracker.started(1, 0)
    ForgetRevoked(tracker).on_partitions_revoked([TopicPartition("prompts", P)])
    tracker.finished(P, 0)  # a record of the revoked partition finishing later is no error
    assert tracker.to_commit() == {1: 0}
