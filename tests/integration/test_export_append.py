"""An export appended to while a run goes on, then imported into a fresh Tansu for a resume: every record at
its own offset, the consumer groups' committed offsets as exported, and a group member starts there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from schemas.messages import encode
from tests.factories import segment
from topics.admin import commit_offsets, committed_offsets, ensure_topics
from topics.broker import EmbeddedBroker
from topics.clients import make_group_consumer, make_producer
from topics.export import ExportError, append_export, import_topics, load_export
from topics.inspect import read_records
from topics.names import PROMPTS, REWARD_GROUP, ROLLOUT_GROUP, SEGMENTS, TopicLayout


async def produce(bootstrap: str, topic: str, indices: range) -> None:
    """Segment i on partition i % 2, each partition's in one batch."""
    async with make_producer(bootstrap, linger_ms=20) as producer:
        queued = [
            await producer.send(topic, encode(segment(trajectory_id=f"p{i}/0", token_ids=[4])), partition=i % 2)
            for i in indices
        ]
        for delivery in queued:
            await delivery


def stored(records) -> list[tuple[int, int, bytes]]:
    return [(r.partition, r.offset, r.value) for r in records]


async def test_appended_chunks_import_with_their_offsets_and_group_commits(
    broker: EmbeddedBroker, unique_name: Callable[[str], str], tmp_path: Path
) -> None:
    layout, path = TopicLayout(unique_name("run") + ".", partitions=2), tmp_path / "topics.export"
    await ensure_topics(broker.bootstrap, layout.names, layout.partitions)
    segments, prompts, reward = layout.name(SEGMENTS), layout.name(PROMPTS), layout.prefix + REWARD_GROUP
    await produce(broker.bootstrap, segments, range(6))
    await commit_offsets(broker.bootstrap, reward, segments, {0: 1})
    first = await append_export(broker.bootstrap, path, layout.prefix)
    assert first[SEGMENTS] == 6 and sum(first.values()) == 6
    assert load_export(path).groups[1].offsets == {0: 1}

    await produce(broker.bootstrap, segments, range(6, 11))  # partition 0 now ends at 6, partition 1 at 5
    await commit_offsets(broker.bootstrap, reward, segments, {0: 6, 1: 2})
    second = await append_export(broker.bootstrap, path, layout.prefix)
    assert second[SEGMENTS] == 5 and sum(second.values()) == 5  # only what was stored since the first chunk
    export, original = load_export(path), stored(await read_records(broker.bootstrap, segments))
    assert [(p, o) for p, o, _ in stored(export.records[SEGMENTS])] == [(0, o) for o in range(6)] + [
        (1, o) for o in range(5)
    ]
    assert stored(export.records[SEGMENTS]) == original
    assert {g.group: g.offsets for g in export.groups} == {REWARD_GROUP: {0: 6, 1: 2}, ROLLOUT_GROUP: {}}

    with EmbeddedBroker(tmp_path / "fresh.log") as fresh:
        assert (await import_topics(path, fresh.bootstrap, layout.prefix))[SEGMENTS] == 11
        assert stored(await read_records(fresh.bootstrap, segments)) == original
        assert await committed_offsets(fresh.bootstrap, reward, segments) == {0: 6, 1: 2}
        assert await committed_offsets(fresh.bootstrap, layout.prefix + ROLLOUT_GROUP, prompts) == {}
        async with make_group_consumer(fresh.bootstrap, segments, reward) as member:
            fetched: dict[int, list[int]] = {0: [], 1: []}
            while len(fetched[1]) < 3:
                for tp, records in (await member.getmany(timeout_ms=2000)).items():
                    fetched[tp.partition] += [r.offset for r in records]
            assert fetched == {0: [], 1: [2, 3, 4]}  # partition 0 was done; partition 1 goes on at 2
            assert await member.committed(TopicPartition(segments, 1)) == 2


async def test_an_export_from_an_unreachable_broker_leaves_the_file_as_it_was_or_none(
    broker: EmbeddedBroker, topic_layout: TopicLayout, tmp_path: Path
) -> None:
    path = tmp_path / "topics.export"
    with EmbeddedBroker(tmp_path / "gone.log") as gone:
        dead = gone.bootstrap
    with pytest.raises(ExportError, match=f"the topics on {dead} cannot be read"):
        await append_export(dead, path, topic_layout.prefix)
    assert not path.exists()  # no export, rather than an empty one
    await append_export(broker.bootstrap, path, topic_layout.prefix)
    before = path.read_bytes()
    with pytest.raises(ExportError, match=f"the topics on {dead} cannot be read"):
        await append_export(dead, path, topic_layout.prefix)
    assert path.read_bytes() == before
