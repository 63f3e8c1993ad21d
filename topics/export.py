"""Export a run's topics to one file and import them into any broker.

A run on the embedded broker lives in memory; exported, it can be replayed
after the broker is gone or loaded into another broker. The import recreates
every topic with its partition count and produces each partition's records in
offset order into empty topics, so the copy has the same offsets: the `batches`
manifests, which name `scored` offsets, stay true.

File format: a stream of frames, each a 4-byte big-endian length followed by a
MessagePack map tagged by `kind`: one `header` (prefix, and each topic's role,
name and partition count), then one `record` per stored record (role,
partition, offset, timestamp, key, value, headers; bytes untouched), then one
`end` with the number of records, so that a truncated file is detected.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec
from aiokafka import AIOKafkaProducer

from topics.admin import ensure_topics
from topics.clients import make_producer
from topics.inspect import read_records, topic_offsets
from topics.names import TopicLayout
from topics.transport import RawRecord

FORMAT_VERSION = 1

_LENGTH = struct.Struct(">I")


class ExportError(RuntimeError):
    """A file that is not a complete export, or a broker it cannot be imported into."""


class ExportedTopic(msgspec.Struct, kw_only=True):
    role: str
    name: str  # the name it had on the exporting broker
    partitions: int


class ExportHeader(msgspec.Struct, tag_field="kind", tag="header", kw_only=True):
    format_version: int = FORMAT_VERSION
    prefix: str
    topics: list[ExportedTopic]


class ExportedRecord(RawRecord, tag_field="kind", tag="record", kw_only=True):
    role: str


class ExportEnd(msgspec.Struct, tag_field="kind", tag="end", kw_only=True):
    records: int


class TopicsExport(msgspec.Struct, kw_only=True):
    """A whole export in memory: its header and the records of each role."""

    header: ExportHeader
    records: dict[str, list[RawRecord]]  # by role, in partition and offset order (ExportedRecord)

    @property
    def partitions(self) -> dict[str, int]:
        return {topic.role: topic.partitions for topic in self.header.topics}


_Frame = ExportHeader | ExportedRecord | ExportEnd
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Frame)


async def export_topics(bootstrap: str, path: str | os.PathLike[str], prefix: str = "") -> dict[str, int]:
    """Write the six run topics under `prefix` to `path`; return the number of records per role.

    Partition counts are the broker's own. The file appears complete or not at
    all (written aside, then renamed).
    """
    layout = TopicLayout(prefix)
    offsets = {spec.role: await topic_offsets(bootstrap, spec.name) for spec in layout.specs}
    header = ExportHeader(prefix=prefix, topics=[
        ExportedTopic(role=spec.role, name=spec.name, partitions=len(offsets[spec.role].partitions))
        for spec in layout.specs
    ])  # fmt: skip
    counts: dict[str, int] = {}
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    try:
        with open(partial, "wb") as out:  # noqa: ASYNC230 - a one-shot command: nothing else runs on its loop
            _write_frame(out, header)
            for spec in layout.specs:
                records = await read_records(bootstrap, spec.name)
                for record in records:
                    _write_frame(out, ExportedRecord(role=spec.role, **msgspec.structs.asdict(record)))
                counts[spec.role] = len(records)
            _write_frame(out, ExportEnd(records=sum(counts.values())))
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return counts


def load_export(path: str | os.PathLike[str]) -> TopicsExport:
    """Read a whole export file, checking that it is complete."""
    frames = _read_frames(Path(path))
    header = next(frames, None)
    if not isinstance(header, ExportHeader):
        raise ExportError(f"{path} does not start with an export header")
    if header.format_version != FORMAT_VERSION:
        raise ExportError(f"{path} has format version {header.format_version}, this build reads {FORMAT_VERSION}")
    records: dict[str, list[RawRecord]] = {topic.role: [] for topic in header.topics}
    for frame in frames:
        if isinstance(frame, ExportEnd):
            _check_end(path, frame, records)
            return TopicsExport(header=header, records=records)
        if not isinstance(frame, ExportedRecord) or frame.role not in records:
            raise ExportError(f"{path}: unexpected frame {frame!r:.200}")
        records[frame.role].append(frame)
    raise ExportError(f"{path} is truncated: it has no end frame")


async def import_topics(path: str | os.PathLike[str], bootstrap: str, prefix: str = "") -> dict[str, int]:
    """Load an export into `bootstrap` under `prefix`; return the number of records per role.

    Creates the topics with the exported partition counts; they must be empty,
    since the copy must keep every record's offset.
    """
    export = load_export(path)
    layout = TopicLayout(prefix, export.partitions)
    await ensure_topics(bootstrap, layout.names, layout.partitions)
    for spec in layout.specs:
        _check_offsets_reproducible(spec.role, export.records[spec.role])
        if (await topic_offsets(bootstrap, spec.name)).count:
            raise ExportError(f"topic {spec.name!r} already holds records; import into empty topics (another prefix)")
    async with make_producer(bootstrap, linger_ms=5) as producer:
        for spec in layout.specs:
            await _produce_in_order(producer, spec.name, export.records[spec.role])
    return {role: len(records) for role, records in export.records.items()}


async def _produce_in_order(producer: AIOKafkaProducer, topic: str, records: list[RawRecord]) -> None:
    # Queue everything, then wait: the producer batches, and keeps one batch
    # in flight per partition, so each partition's order is the offset order.
    deliveries = [
        await producer.send(
            topic,
            record.value,
            key=record.key,
            partition=record.partition,
            timestamp_ms=record.timestamp,
            headers=record.headers,
        )
        for record in records
    ]
    for record, delivery in zip(records, deliveries, strict=True):
        landed = (await delivery).offset
        if landed != record.offset:
            raise ExportError(f"{topic} partition {record.partition}: record {record.offset} landed at offset {landed}")


def _check_offsets_reproducible(role: str, records: list[RawRecord]) -> None:
    """A fresh topic numbers records from 0 without gaps: the export must too."""
    next_offset: dict[int, int] = {}
    for record in records:
        expected = next_offset.get(record.partition, 0)
        if record.offset != expected:
            raise ExportError(
                f"{role} partition {record.partition} has offset {record.offset} where {expected} "
                "was expected; an import could not keep the offsets"
            )
        next_offset[record.partition] = expected + 1


def _write_frame(out: BinaryIO, frame: _Frame) -> None:
    body = _ENCODER.encode(frame)
    out.write(_LENGTH.pack(len(body)))
    out.write(body)


def _read_frames(path: Path) -> Iterator[_Frame]:
    with open(path, "rb") as source:
        while prefix := source.read(_LENGTH.size):
            size = _LENGTH.unpack(prefix)[0] if len(prefix) == _LENGTH.size else -1
            body = source.read(max(size, 0))
            if len(body) != size:
                raise ExportError(f"{path} is truncated in the middle of a frame")
            try:
                yield _DECODER.decode(body)
            except msgspec.DecodeError as exc:
                raise ExportError(f"{path} holds a frame that is not part of an export: {exc}") from exc


def _check_end(path: str | os.PathLike[str], end: ExportEnd, records: dict[str, list[RawRecord]]) -> None:
    found = sum(len(role_records) for role_records in records.values())
    if found != end.records:
        raise ExportError(f"{path} announces {end.records} records but holds {found}")
