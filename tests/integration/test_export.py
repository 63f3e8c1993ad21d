"""Topic export/import and `asyncrl topics`, against real Tansu brokers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from pipeline.cli import main
from schemas.messages import BatchManifest, DeadLetter, Segment, WeightVersion
from tests import factories
from topics.admin import ensure_topics
from topics.broker import EmbeddedBroker
from topics.clients import make_producer, send, send_and_wait
from topics.export import ExportEnd, ExportError, export_topics, import_topics, load_export
from topics.inspect import describe_topics, read_records, topic_offsets
from topics.names import BATCHES, DEAD_LETTER, SEGMENTS, WEIGHTS, TopicLayout

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def segment(trajectory_id: str, index: int) -> Segment:
    return factories.segment(
        trajectory_id=trajectory_id,
        segment_index=index,
        version=index,
        logprobs=[-0.5, -0.25],
        finish_reason="interrupted",
    )


async def fill(bootstrap: str, layout: TopicLayout) -> None:
    """Records on several partitions: one multi-record batch, single sends, a null key, bad bytes."""
    async with make_producer(bootstrap, linger_ms=50) as producer:
        queued = [
            await send(producer, layout.name(SEGMENTS), segment(f"p/{i % 4}/0", i), key=f"p/{i % 4}/0",
                       headers={"traceparent": TRACEPARENT})
            for i in range(12)
        ]  # fmt: skip
        for delivery in queued:
            await delivery
        await send_and_wait(producer, layout.name(WEIGHTS), WeightVersion(
            version=1, uri="/w/1", content_hash="ab" * 32, step=1, groups_consumed=2, groups_dropped=0,
        ))  # fmt: skip
        manifest = BatchManifest(step=1, trainer_version=0, trajectory_ids=[], scored_offsets=[], consumed_offsets=[])
        await send_and_wait(producer, layout.name(BATCHES), manifest, key=1)
        await producer.send_and_wait(layout.name(DEAD_LETTER), b"\xc1 not msgpack", key=b"\x00\xff", partition=1)
        letter = DeadLetter(origin="reward-0", source="segments", reason="bad", payload=b"\x00")
        await send_and_wait(producer, layout.name(DEAD_LETTER), letter, key=letter.origin)


@pytest.fixture
async def wide_layout(broker: EmbeddedBroker, unique_name: Callable[[str], str]) -> TopicLayout:
    """The run topics with three partitions each (weights one), filled with records."""
    layout = TopicLayout(prefix=unique_name("run") + ".", partitions=3)
    await ensure_topics(broker.bootstrap, layout.names, layout.partitions)
    await fill(broker.bootstrap, layout)
    return layout


def stored(record) -> tuple:
    return (record.partition, record.offset, record.timestamp, record.key, record.value, record.headers)


async def test_offsets_count_every_record_of_a_multi_record_batch(
    broker: EmbeddedBroker, topic_layout: TopicLayout
) -> None:
    async with make_producer(broker.bootstrap, linger_ms=50) as producer:
        queued = [await send(producer, topic_layout.name(SEGMENTS), segment("p/0/0", i)) for i in range(7)]
        offsets = [(await delivery).offset for delivery in queued]
    assert offsets == list(range(7))

    segments = await topic_offsets(broker.bootstrap, topic_layout.name(SEGMENTS))
    assert (segments.partitions[0].start, segments.partitions[0].end, segments.count) == (0, 7, 7)
    described = {topic.name: topic.count for topic in await describe_topics(broker.bootstrap, topic_layout.prefix)}
    assert described == {name: 7 if name == topic_layout.name(SEGMENTS) else 0 for name in topic_layout.names}
    assert len(await read_records(broker.bootstrap, topic_layout.name(SEGMENTS), from_offset=5)) == 2


def test_topics_command_lists_counts_per_partition(
    broker: EmbeddedBroker, wide_layout: TopicLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["topics", "--bootstrap", broker.bootstrap, "--prefix", wide_layout.prefix]) == 0
    out = capsys.readouterr().out
    assert f"{wide_layout.name(SEGMENTS)}  3 partitions  12 messages" in out
    assert f"{wide_layout.name(DEAD_LETTER)}  3 partitions  2 messages" in out
    assert f"{wide_layout.name(WEIGHTS)}  1 partitions  1 messages" in out
    assert out.count("partition ") == 3 * 5 + 1


async def test_export_then_import_keeps_bytes_and_offsets(
    broker: EmbeddedBroker, wide_layout: TopicLayout, tmp_path: Path
) -> None:
    path = tmp_path / "run.topics"
    counts = await export_topics(broker.bootstrap, path, wide_layout.prefix)
    assert counts == {"prompts": 0, "segments": 12, "scored": 0, "weights": 1, "batches": 1, "dead-letter": 2}
    assert load_export(path).partitions == {spec.role: spec.partitions for spec in wide_layout.specs}

    with EmbeddedBroker(tmp_path / "fresh.log") as fresh:
        assert await import_topics(path, fresh.bootstrap, "copy.") == counts
        copy = TopicLayout("copy.", 3)
        for spec in wide_layout.specs:
            original = await read_records(broker.bootstrap, spec.name)
            imported = await read_records(fresh.bootstrap, copy.name(spec.role))
            assert [stored(r) for r in imported] == [stored(r) for r in original], spec.role
            assert len((await topic_offsets(fresh.bootstrap, copy.name(spec.role))).partitions) == spec.partitions
        with pytest.raises(ExportError, match="already holds records"):
            await import_topics(path, fresh.bootstrap, "copy.")


def test_export_and_import_commands(
    broker: EmbeddedBroker, wide_layout: TopicLayout, tmp_path: Path, unique_name: Callable[[str], str],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    path, prefix = tmp_path / "run.topics", unique_name("copy") + "."
    assert (
        main(["topics", "export", "--bootstrap", broker.bootstrap, "--prefix", wide_layout.prefix, "--out", str(path)])
        == 0
    )
    assert main(["topics", "import", str(path), "--bootstrap", broker.bootstrap, "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert "exported 16 records" in out and "imported 16 records" in out


async def test_a_truncated_export_is_refused(broker: EmbeddedBroker, wide_layout: TopicLayout, tmp_path: Path) -> None:
    path = tmp_path / "run.topics"
    await export_topics(broker.bootstrap, path, wide_layout.prefix)
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])
    with pytest.raises(ExportError, match="truncated"):
        load_export(path)
    end_frame = 4 + len(msgspec.msgpack.encode(ExportEnd(records=16)))
    path.write_bytes(whole[:-end_frame])  # cut between two frames
    with pytest.raises(ExportError, match="truncated"):
        load_export(path)
