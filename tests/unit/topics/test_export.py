"""The export file as the trainer appends to it at each checkpoint: chunks read back in offset order, a torn
chunk ignored and then cut off, where the next chunk starts, and the checks that keep offsets identical in a
copy. No broker: the chunks are written with `ExportAppender` directly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from topics import export
from topics.export import (
    ExportAppender,
    ExportedGroup,
    ExportedRecord,
    ExportedTopic,
    ExportEnd,
    ExportError,
    ExportHeader,
    _check_committed,
    _check_offsets_reproducible,
    _write_frame,
    append_export,
    load_export,
    next_offsets,
)

HEADER = ExportHeader(prefix="run.", topics=[
    ExportedTopic(role="scored", name="run.scored", partitions=2),
    ExportedTopic(role="batches", name="run.batches", partitions=1),
])  # fmt: skip


def record(role: str, partition: int, offset: int) -> ExportedRecord:
    value = f"{role}:{partition}:{offset}".encode()
    return ExportedRecord(role=role, partition=partition, offset=offset, timestamp=offset, key=None, value=value,
                          headers=[("schema", b"Scored")])  # fmt: skip


def reward_group(*offsets: int) -> ExportedGroup:
    return ExportedGroup(group="reward", role="segments", offsets=dict(enumerate(offsets)))


def places(records) -> list[tuple[int, int]]:
    return [(r.partition, r.offset) for r in records]


def write_two_chunks(path: Path) -> Path:
    """Chunk 1: scored 0:0, 0:1, 1:0 and batches 0:0; chunk 2: scored 1:1, 0:2 (partitions interleaved)."""
    with ExportAppender(path) as appender:
        assert appender.header is None and appender.next_offsets() == {}
        chunk = [record("batches", 0, 0), record("scored", 0, 0), record("scored", 0, 1), record("scored", 1, 0)]
        appender.append(HEADER, chunk, [reward_group(1)])
    with ExportAppender(path) as appender:
        assert appender.header == HEADER
        assert appender.next_offsets() == {"batches": {0: 1}, "scored": {0: 2, 1: 1}}
        appender.append(HEADER, [record("scored", 1, 1), record("scored", 0, 2)], [reward_group(3)])
    return path


@pytest.fixture
def two_chunks(tmp_path: Path) -> Path:
    return write_two_chunks(tmp_path / "topics.export")


def test_chunks_read_back_in_offset_order_with_the_last_groups(two_chunks: Path) -> None:
    export = load_export(two_chunks)
    assert places(export.records["scored"]) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert [r.value for r in export.records["scored"]][2:4] == [b"scored:0:2", b"scored:1:0"]
    assert places(export.records["batches"]) == [(0, 0)]
    assert export.groups == [reward_group(3)] and export.partitions == {"scored": 2, "batches": 1}


def test_a_torn_chunk_is_ignored_then_cut_off_by_the_next_append(two_chunks: Path) -> None:
    committed = two_chunks.read_bytes()
    with open(two_chunks, "ab") as out:  # a crash mid-append: two records, then half a frame, no end
        _write_frame(out, record("scored", 0, 3))
        _write_frame(out, record("batches", 0, 1))
        out.write(b"\x00\x00\x01")
    assert places(load_export(two_chunks).records["scored"]) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    with ExportAppender(two_chunks) as appender:
        assert appender.next_offsets() == {"batches": {0: 1}, "scored": {0: 3, 1: 2}}
        appender.append(HEADER, [record("batches", 0, 1)], [reward_group(4)])
    assert two_chunks.read_bytes().startswith(committed)
    export = load_export(two_chunks)
    assert places(export.records["batches"]) == [(0, 0), (0, 1)] and len(export.records["scored"]) == 5
    assert export.groups == [reward_group(4)]


def test_a_file_without_an_end_starts_anew(tmp_path: Path) -> None:
    path = tmp_path / "topics.export"
    with open(path, "wb") as out:  # killed during its first chunk
        _write_frame(out, HEADER)
        _write_frame(out, record("scored", 0, 0))
    with pytest.raises(ExportError, match="truncated"):
        load_export(path)
    with ExportAppender(path) as appender:
        assert appender.header is None and appender.next_offsets() == {}
        appender.append(HEADER, [record("batches", 0, 0)], [])
    export = load_export(path)
    assert places(export.records["batches"]) == [(0, 0)] and export.records["scored"] == []


def test_an_end_that_miscounts_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "topics.export"
    with open(path, "wb") as out:
        _write_frame(out, HEADER)
        _write_frame(out, record("scored", 0, 0))
        _write_frame(out, ExportEnd(records=2))
    with pytest.raises(ExportError, match="announces 2 records but holds 1"):
        load_export(path)


def test_an_older_file_is_read_but_not_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "topics.export"
    with open(path, "wb") as out:
        _write_frame(out, ExportHeader(format_version=1, prefix="run.", topics=HEADER.topics))
        _write_frame(out, record("scored", 1, 0))
        _write_frame(out, ExportEnd(records=1))
    assert places(load_export(path).records["scored"]) == [(1, 0)] and load_export(path).groups == []
    before = path.read_bytes()
    with pytest.raises(ExportError, match="format 1"):  # refused before any broker is asked
        asyncio.run(append_export("127.0.0.1:9", path, "run."))
    assert path.read_bytes() == before


def test_next_offsets_are_one_past_the_highest_per_partition() -> None:
    records = [record("scored", 1, 4), record("scored", 0, 0), record("scored", 1, 2), record("prompts", 2, 9)]
    assert next_offsets(records) == {"scored": {0: 1, 1: 5}, "prompts": {2: 10}}
    assert next_offsets([]) == {}


def test_offsets_must_be_reproducible_from_zero_without_gaps() -> None:
    _check_offsets_reproducible("scored", [record("scored", 0, 0), record("scored", 1, 0), record("scored", 0, 1)])
    with pytest.raises(ExportError, match="partition 1 has offset 3 where 2 was expected"):
        _check_offsets_reproducible("scored", [record("scored", 1, o) for o in (0, 1, 3)])
    with pytest.raises(ExportError, match="partition 0 has offset 1 where 0 was expected"):
        _check_offsets_reproducible("scored", [record("scored", 0, 1)])


def test_a_committed_offset_may_reach_but_not_pass_the_records_exported() -> None:
    _check_committed(reward_group(3, 0), {0: 3})  # at the end of partition 0; partition 1 empty, committed 0
    with pytest.raises(ExportError, match="committed offset 4 of segments partition 0, past the 3 records"):
        _check_committed(reward_group(4), {0: 3})
    with pytest.raises(ExportError, match="committed offset 1 of segments partition 1, past the 0 records"):
        _check_committed(reward_group(0, 1), {0: 3})


def test_an_append_after_this_processs_own_goes_on_without_reading_the_file(two_chunks: Path, monkeypatch) -> None:
    """The trainer appends before every checkpoint: re-reading the whole file each time grew with the run."""

    def scan(*args):
        raise AssertionError("the file was scanned")

    monkeypatch.setattr(export, "_committed", scan)
    with ExportAppender(two_chunks) as appender:
        assert appender.header == HEADER
        assert appender.next_offsets() == {"batches": {0: 1}, "scored": {0: 3, 1: 2}}
        appender.append(HEADER, [record("scored", 0, 3), record("batches", 0, 1)], [reward_group(5)])
    monkeypatch.undo()
    export_ = load_export(two_chunks)
    assert places(export_.records["scored"]) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert places(export_.records["batches"]) == [(0, 0), (0, 1)] and export_.groups == [reward_group(5)]
