from aiokafka import TopicPartition

from topics.commits import CommitTracker

TP = TopicPartition("prompts", 0)


def test_commits_only_up_to_the_oldest_record_in_flight():
    tracker = CommitTracker()
    for offset in (5, 6, 7):
        tracker.started(TP, offset)
    tracker.finished(TP, 6)
    assert tracker.to_commit() == {TP: 5}  # 5 still in flight: a restart re-reads 5, 6, 7
    tracker.finished(TP, 5)
    assert tracker.to_commit() == {TP: 7}
    assert tracker.to_commit() == {}  # nothing moved
    tracker.finished(TP, 7)
    assert tracker.to_commit() == {TP: 8}


def test_revoked_partitions_are_forgotten_and_not_committed():
    tracker = CommitTracker()
    tracker.started(TP, 0)
    tracker.rebalance_listener().on_partitions_revoked([TP])
    tracker.finished(TP, 0)  # a record of the revoked partition finishing later is no error
    assert tracker.to_commit() == {}
