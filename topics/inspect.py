"""Look at a broker's topics from outside a run: offsets, counts and raw records.

Operators and replay read without joining a group and without decoding, so
they see exactly what is stored. The end of a partition is the high watermark
of a fetch response, never `end_offsets()` (Tansu answers it with the base
offset of the last batch plus one: short after a multi-record batch, see
topics/readers.py). `end_offsets()` is only used as a hint of where to fetch
from, so that finding the end transfers one batch, not the whole partition.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import msgspec
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from topics.clients import assigned_consumer
from topics.transport import RawRecord

_FETCH_WAIT_MS = 100

BrokerError = KafkaError  # what the Kafka client raises, for callers outside topics/ (which never import aiokafka)


class PartitionOffsets(msgspec.Struct, frozen=True):
    start: int  # the first offset still stored (0 unless a broker deleted old records)
    end: int  # the high watermark: one past the last record

    @property
    def count(self) -> int:
        return self.end - self.start


class TopicOffsets(msgspec.Struct, frozen=True):
    name: str
    partitions: dict[int, PartitionOffsets]

    @property
    def count(self) -> int:
        return sum(offsets.count for offsets in self.partitions.values())


async def list_topic_names(bootstrap: str, prefix: str = "") -> list[str]:
    """The broker's topics whose names start with `prefix`, sorted."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    try:
        await consumer.start()
        # Listing all topics names none, so Tansu creates nothing by accident.
        return sorted(name for name in await consumer.topics() if name.startswith(prefix))
    finally:
        await consumer.stop()


async def topic_offsets(bootstrap: str, topic: str, *, timeout_s: float = 30.0) -> TopicOffsets:
    """First offset and high watermark of every partition of `topic`."""
    async with assigned_consumer(bootstrap, topic, fetch_max_wait_ms=_FETCH_WAIT_MS) as consumer:
        partitions = sorted(consumer.assignment(), key=lambda tp: tp.partition)
        starts = await consumer.beginning_offsets(partitions)
        hints = await consumer.end_offsets(partitions)
        for tp in partitions:
            consumer.seek(tp, max(starts[tp], hints[tp] - 1))
        try:
            async with asyncio.timeout(timeout_s):
                ends = await _high_watermarks(consumer, partitions)
        except TimeoutError:
            raise TimeoutError(f"no fetch of {topic!r} answered in {timeout_s} s") from None
    return TopicOffsets(topic, {tp.partition: PartitionOffsets(starts[tp], ends[tp]) for tp in partitions})


async def describe_topics(bootstrap: str, prefix: str = "") -> list[TopicOffsets]:
    """Offsets of every topic whose name starts with `prefix`."""
    return [await topic_offsets(bootstrap, name) for name in await list_topic_names(bootstrap, prefix)]


async def read_records(
    bootstrap: str, topic: str, *, from_offset: int | Mapping[int, int] = 0, timeout_s: float = 60.0
) -> list[RawRecord]:
    """Every record of `topic` from `from_offset` (every partition's, or per partition: 0 for those not named)
    to its end, by partition and offset.

    The end is the high watermark when the call starts: records produced
    meanwhile are not waited for.
    """
    bounds = (await topic_offsets(bootstrap, topic)).partitions
    wanted = from_offset if isinstance(from_offset, Mapping) else dict.fromkeys(bounds, from_offset)
    starts = {p: min(max(wanted.get(p, 0), b.start), b.end) for p, b in bounds.items()}
    if all(starts[p] == b.end for p, b in bounds.items()):
        return []
    async with assigned_consumer(bootstrap, topic, starts, fetch_max_wait_ms=_FETCH_WAIT_MS) as consumer:
        try:
            async with asyncio.timeout(timeout_s):
                return await _read_until(consumer, topic, {p: b.end for p, b in bounds.items()})
        except TimeoutError:
            raise TimeoutError(f"reading {topic!r} did not reach its end in {timeout_s} s") from None


async def _high_watermarks(consumer: AIOKafkaConsumer, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
    while any(consumer.highwater(tp) is None for tp in partitions):
        await consumer.getmany(*partitions, timeout_ms=_FETCH_WAIT_MS, max_records=1)
    return {tp: consumer.highwater(tp) for tp in partitions}


async def _read_until(consumer: AIOKafkaConsumer, topic: str, ends: Mapping[int, int]) -> list[RawRecord]:
    pending = {TopicPartition(topic, p) for p in ends}
    records: list[RawRecord] = []
    while pending:
        for tp in [tp for tp in pending if await consumer.position(tp) >= ends[tp.partition]]:
            pending.discard(tp)
        if not pending:
            break
        fetched = await consumer.getmany(*pending, timeout_ms=200)
        for tp, batch in fetched.items():
            records += [raw_record(record) for record in batch if record.offset < ends[tp.partition]]
    return sorted(records, key=lambda record: (record.partition, record.offset))


def raw_record(record: ConsumerRecord) -> RawRecord:
    return RawRecord(
        partition=record.partition,
        offset=record.offset,
        timestamp=record.timestamp,
        key=record.key,
        value=record.value,
        headers=[(name, bytes(value)) for name, value in record.headers],
    )
