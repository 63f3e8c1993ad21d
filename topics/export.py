"""Export a run's topics to one file, append to it as they grow, and import them into any broker.

A run on the embedded broker lives in memory; exported, it can be replayed
after the broker is gone, loaded into another broker, or resumed (`asyncrl run
--resume`). The import recreates every topic with its partition count and
produces each partition's records in offset order into empty topics, so the
copy has the same offsets (a fresh broker numbers a partition's records 0, 1,
2, ... whether they come one per request or in batches; each landing offset is
checked): the `batches` manifests and the trainer's checkpoints, which name
`scored` offsets, stay true. It then commits the consumer groups' offsets as
they were, so the rollout and reward workers go on from where they had got to.

File format (version 2): a stream of frames, each a 4-byte big-endian length
followed by a MessagePack map tagged by `kind`: one `header` (prefix, and each
topic's role, name and partition count), then chunks of `record` frames (role,
partition, offset, timestamp, key, value, headers; bytes untouched), each ended
by an `end` frame (the number of records in the file so far, and the consumer
groups' committed offsets). `append_export` adds a chunk with what was stored
since the last one, so the trainer can export before every checkpoint without
rewriting the file. An `end` commits its chunk: a chunk torn by a crash (no
`end` after it) is ignored when the file is read and cut off by the next
append; a file without any `end` is truncated.
"""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from topics.admin import commit_offsets, committed_offsets, ensure_topics
from topics.clients import make_producer
from topics.inspect import read_records, topic_offsets
from topics.names import BATCHES, CONSUMER_GROUPS, DEAD_LETTER, PROMPTS, SCORED, SEGMENTS, WEIGHTS, TopicLayout
from topics.transport import RawRecord

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: one chunk, no consumer groups (it is read, never appended to)

# Effects before their causes, and the groups' committed offsets before any topic, so whatever a record or a
# committed offset of a chunk follows from was stored before it was read, and is in the file too, however far
# the other workers get meanwhile. The trainer, which alone writes `batches` and `weights` (and reads `prompts`
# for deadlines), is not running while it or the launcher exports: it is the exporter, or it has stopped.
EXPORT_ORDER = (DEAD_LETTER, BATCHES, WEIGHTS, SCORED, SEGMENTS, PROMPTS)

_LENGTH = struct.Struct(">I")


class ExportError(RuntimeError):
    """A file that is not a complete export, or a broker it cannot be exported from or imported into."""


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


class ExportedGroup(msgspec.Struct, kw_only=True):
    """A consumer group's committed offsets when a chunk was read."""

    group: str  # its name after the topic prefix (topics.names.CONSUMER_GROUPS)
    role: str  # the topic it reads
    offsets: dict[int, int]  # partition -> committed offset; partitions it never committed are left out


class ExportEnd(msgspec.Struct, tag_field="kind", tag="end", kw_only=True):
    records: int  # in the file up to this frame
    groups: list[ExportedGroup] = []


class TopicsExport(msgspec.Struct, kw_only=True):
    """A whole export in memory: its header, the records of each role and the groups' last offsets."""

    header: ExportHeader
    records: dict[str, list[RawRecord]]  # by role, in partition and offset order (ExportedRecord)
    groups: list[ExportedGroup] = []

    @property
    def partitions(self) -> dict[str, int]:
        return {topic.role: topic.partitions for topic in self.header.topics}


class _Place(msgspec.Struct, tag_field="kind", tag="record"):
    """A record frame read for its place alone: the scan before an append skips the bytes."""

    role: str
    partition: int
    offset: int


_Frame = ExportHeader | ExportedRecord | ExportEnd
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Frame)
_SCANNER = msgspec.msgpack.Decoder(ExportHeader | _Place | ExportEnd)


@dataclass
class _Committed:
    """What a file holds up to its last `end` frame."""

    header: ExportHeader | None = None
    records: list = field(default_factory=list)  # ExportedRecord or _Place, in file order
    end: ExportEnd | None = None
    size: int = 0  # bytes up to the last `end` frame; 0 when there is none


@dataclass(frozen=True)
class _Tail:
    """Where the next append goes on: the committed header (None: the file starts anew), record count, next
    offsets per role and partition, and size."""

    header: ExportHeader | None
    count: int
    offsets: dict[str, dict[int, int]]
    size: int


# per file (device, inode): its (size, mtime) as this process's last append left it, and that append's tail.
# The trainer appends before every checkpoint; scanning the whole file each time made checkpoints grow with the
# run (a 1,200-step arith run: 103 MB, 0.7 s a scan at the end). Any other change to the file means a scan.
_LEFT: dict[tuple[int, int], tuple[tuple[int, int], _Tail]] = {}


async def export_topics(bootstrap: str, path: str | os.PathLike[str], prefix: str = "") -> dict[str, int]:
    """Write the six run topics under `prefix` and the groups' offsets to a new file at `path`; return the
    number of records per role. The file appears complete or not at all (written aside, then renamed)."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        counts = await append_export(bootstrap, partial, prefix)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return counts


async def append_export(bootstrap: str, path: str | os.PathLike[str], prefix: str = "") -> dict[str, int]:
    """Add to `path` (made if missing) one chunk: every record stored under `prefix` since the file's last
    chunk, and the consumer groups' committed offsets; return the number of records added per role.

    Raises ExportError, leaving the file as it was, when the broker cannot be read.
    """
    layout = TopicLayout(prefix)
    with ExportAppender(path) as appender:
        header = appender.header
        if header is not None and (header.prefix, header.format_version) != (prefix, FORMAT_VERSION):
            raise ExportError(
                f"{path} holds prefix {header.prefix!r} in format {header.format_version}: "
                f"no chunk of prefix {prefix!r} in format {FORMAT_VERSION} can follow"
            )
        with _broker_errors(bootstrap):
            header = header or await _new_header(bootstrap, layout)
            records, groups = await _read_chunk(bootstrap, layout, appender.next_offsets())
        appender.append(header, records, groups)
    counts = dict.fromkeys((spec.role for spec in layout.specs), 0)
    for record in records:
        counts[record.role] += 1
    return counts


class ExportAppender:
    """Adds one chunk to an export file, holding an exclusive lock on it meanwhile: the trainer appends before
    each checkpoint, the launcher when the run stops, and neither may interleave its frames with the other's."""

    def __init__(self, path: str | os.PathLike[str]):
        self.file = open(path, "a+b")  # noqa: SIM115 - closed by __exit__; made when missing, writes go to the end
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX)
            self.tail = self._tail()
        except BaseException:
            self.file.close()
            raise

    def _tail(self) -> _Tail:
        """The committed part of the file: remembered from this process's last append if the file is as that
        left it, else scanned."""
        stat = os.fstat(self.file.fileno())
        left = _LEFT.get((stat.st_dev, stat.st_ino))
        if left is not None and left[0] == (stat.st_size, stat.st_mtime_ns):
            return left[1]
        self.file.seek(0)
        done = _committed(self.file, _SCANNER)
        return _Tail(done.header if done.end else None, len(done.records), next_offsets(done.records), done.size)

    @property
    def header(self) -> ExportHeader | None:
        """The file's header, once a chunk after it is committed (else the file starts anew)."""
        return self.tail.header

    def next_offsets(self) -> dict[str, dict[int, int]]:
        """Per role and partition, the first offset the file does not hold yet: where the next chunk starts."""
        return next_offsets((), self.tail.offsets)

    def append(self, header: ExportHeader, records: list[ExportedRecord], groups: list[ExportedGroup]) -> None:
        """Cut off a torn chunk, write `records` and the `end` that commits them (the header first in a new
        file), and return once they are on disk."""
        tail = self.tail
        self.file.truncate(tail.size)
        self.file.seek(tail.size)
        if not tail.size:
            _write_frame(self.file, header)
        for record in records:
            _write_frame(self.file, record)
        count = tail.count + len(records)
        _write_frame(self.file, ExportEnd(records=count, groups=groups))
        self.file.flush()
        os.fsync(self.file.fileno())
        offsets = next_offsets(records, tail.offsets)
        stat = os.fstat(self.file.fileno())
        self.tail = _Tail(tail.header if tail.size else header, count, offsets, stat.st_size)
        _LEFT[stat.st_dev, stat.st_ino] = ((stat.st_size, stat.st_mtime_ns), self.tail)

    def __enter__(self) -> ExportAppender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Release the file and its lock; a file this appender made and left empty (the broker could not be
        read) is removed, so that no run seems to have an export it does not have."""
        if self.file.seek(0, os.SEEK_END) == 0:
            Path(self.file.name).unlink(missing_ok=True)
        self.file.close()


def next_offsets(
    records: Iterable[ExportedRecord | _Place], held: Mapping[str, Mapping[int, int]] | None = None
) -> dict[str, dict[int, int]]:
    """Per role and partition, one past the highest offset of `records` and of what `held` says is already
    held (next offsets, as this returns them): where reading goes on, and the furthest a consumer group's
    committed offset may point."""
    found = {role: dict(partitions) for role, partitions in (held or {}).items()}
    for record in records:
        partitions = found.setdefault(record.role, {})
        partitions[record.partition] = max(partitions.get(record.partition, 0), record.offset + 1)
    return found


def load_export(path: str | os.PathLike[str]) -> TopicsExport:
    """Read an export file up to its last `end` frame (a torn chunk after it is ignored), checking its counts."""
    with open(path, "rb") as source:
        done = _committed(source, _DECODER)
    if done.header is None:
        raise ExportError(f"{path} does not start with an export header")
    if done.end is None:
        raise ExportError(f"{path} is truncated: it has no end frame")
    records: dict[str, list[RawRecord]] = {topic.role: [] for topic in done.header.topics}
    for record in sorted(done.records, key=lambda record: (record.partition, record.offset)):
        records[record.role].append(record)
    return TopicsExport(header=done.header, records=records, groups=done.end.groups)


async def import_topics(path: str | os.PathLike[str], bootstrap: str, prefix: str = "") -> dict[str, int]:
    """Load an export into `bootstrap` under `prefix`, then commit its consumer groups' offsets there; return
    the number of records per role.

    Creates the topics with the exported partition counts; they must be empty,
    since the copy must keep every record's offset, and its groups without members.
    """
    export = load_export(path)
    layout = TopicLayout(prefix, export.partitions)
    ends = next_offsets(record for records in export.records.values() for record in records)
    for group in export.groups:
        _check_committed(group, ends.get(group.role, {}))
    await ensure_topics(bootstrap, layout.names, layout.partitions)
    for spec in layout.specs:
        _check_offsets_reproducible(spec.role, export.records[spec.role])
        if (await topic_offsets(bootstrap, spec.name)).count:
            raise ExportError(f"topic {spec.name!r} already holds records; import into empty topics (another prefix)")
    async with make_producer(bootstrap, linger_ms=5) as producer:
        for spec in layout.specs:
            await _produce_in_order(producer, spec.name, export.records[spec.role])
    for group in export.groups:
        await commit_offsets(bootstrap, prefix + group.group, layout.name(group.role), group.offsets)
    return {role: len(records) for role, records in export.records.items()}


@contextmanager
def _broker_errors(bootstrap: str) -> Iterator[None]:
    """A broker that cannot be read is an ExportError: the caller decides (the trainer skips its checkpoint)."""
    try:
        yield
    except (KafkaError, LookupError, TimeoutError, ConnectionError) as exc:
        raise ExportError(f"the topics on {bootstrap} cannot be read: {exc!r}") from exc


async def _new_header(bootstrap: str, layout: TopicLayout) -> ExportHeader:
    """A new file's header: each topic with its partition count on the broker."""
    offsets = {spec.role: await topic_offsets(bootstrap, spec.name) for spec in layout.specs}
    return ExportHeader(prefix=layout.prefix, topics=[
        ExportedTopic(role=spec.role, name=spec.name, partitions=len(offsets[spec.role].partitions))
        for spec in layout.specs
    ])  # fmt: skip


async def _read_chunk(
    bootstrap: str, layout: TopicLayout, starts: Mapping[str, Mapping[int, int]]
) -> tuple[list[ExportedRecord], list[ExportedGroup]]:
    """The groups' committed offsets, then every record from `starts` on, the topics in EXPORT_ORDER."""
    groups = [
        ExportedGroup(
            group=group, role=role, offsets=await committed_offsets(bootstrap, layout.prefix + group, layout.name(role))
        )
        for group, role in CONSUMER_GROUPS.items()
    ]
    records = []
    for role in EXPORT_ORDER:
        stored = await read_records(bootstrap, layout.name(role), from_offset=starts.get(role, {}))
        records += [ExportedRecord(role=role, **msgspec.structs.asdict(record)) for record in stored]
    return records, groups


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


def _check_committed(group: ExportedGroup, ends: Mapping[int, int]) -> None:
    """A committed offset past the records exported would make the group skip records the copy never gets."""
    for partition, offset in group.offsets.items():
        if offset > ends.get(partition, 0):
            raise ExportError(
                f"group {group.group!r} committed offset {offset} of {group.role} partition {partition}, "
                f"past the {ends.get(partition, 0)} records exported"
            )


def _committed(source: BinaryIO, decoder: msgspec.msgpack.Decoder) -> _Committed:
    """What `source` holds up to its last `end` frame; a chunk torn after it (a crash mid-append) is left out."""
    done, pending, roles = _Committed(), [], set()
    for frame, position in _frames(source, decoder):
        if done.header is None:
            done.header = _checked_header(source.name, frame)
            roles = {topic.role for topic in done.header.topics}
        elif isinstance(frame, ExportEnd):
            done.records += pending
            pending = []
            if len(done.records) != frame.records:
                raise ExportError(f"{source.name} announces {frame.records} records but holds {len(done.records)}")
            done.end, done.size = frame, position
        elif isinstance(frame, (ExportedRecord, _Place)) and frame.role in roles:
            pending.append(frame)
        else:
            raise ExportError(f"{source.name}: unexpected frame {frame!r:.200}")
    return done


def _checked_header(name: str, frame: object) -> ExportHeader:
    if not isinstance(frame, ExportHeader):
        raise ExportError(f"{name} does not start with an export header")
    if frame.format_version not in READABLE_VERSIONS:
        raise ExportError(f"{name} has format version {frame.format_version}, this build reads {READABLE_VERSIONS}")
    return frame


def _write_frame(out: BinaryIO, frame: _Frame) -> None:
    body = _ENCODER.encode(frame)
    out.write(_LENGTH.pack(len(body)))
    out.write(body)


def _frames(source: BinaryIO, decoder: msgspec.msgpack.Decoder) -> Iterator[tuple[object, int]]:
    """Each whole frame and the file offset just after it; a frame torn at the end (a crash mid-write) ends it."""
    position = 0
    while len(prefix := source.read(_LENGTH.size)) == _LENGTH.size:
        size = _LENGTH.unpack(prefix)[0]
        body = source.read(size)
        if len(body) != size:
            return
        position += _LENGTH.size + size
        try:
            frame = decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise ExportError(f"{source.name} holds a frame that is not part of an export: {exc}") from exc
        yield frame, position
