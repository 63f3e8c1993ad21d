"""Read a whole topic, from the beginning to its end at the time of the call.

The end of a partition is taken from the high watermark of a fetch response,
never from `end_offsets()`/`seek_to_end()`: Tansu answers ListOffsets with the
base offset of the last batch plus one, which is short once a produce batch
holds several records. Fetch responses carry the right watermark on every broker.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.messages import DecodeError, Message, decode
from topics.clients import assigned_consumer

M = TypeVar("M", bound=Message)


class TopicRecord(NamedTuple):
    partition: int
    offset: int
    message: Message | DecodeError  # the error, for bytes that do not decode


async def read_topic(
    bootstrap: str, topic: str, cls: type[M], *, timeout_s: float = 60.0
) -> list[TopicRecord]:
    """Every record of `topic`, decoded as `cls`, ordered by partition and offset."""
    async with assigned_consumer(bootstrap, topic, fetch_max_wait_ms=100) as consumer:
        try:
            async with asyncio.timeout(timeout_s):
                return await _read_to_end(consumer, cls)
        except TimeoutError:
            raise TimeoutError(f"reading {topic!r} did not reach its end in {timeout_s} s") from None


async def _read_to_end(consumer: AIOKafkaConsumer, cls: type[M]) -> list[TopicRecord]:
    ends: dict[TopicPartition, int] = {}  # the first watermark seen: later records are not ours
    pending = set(consumer.assignment())
    records: list[TopicRecord] = []
    while pending:
        fetched = await consumer.getmany(*pending, timeout_ms=200)
        for tp in list(pending):
            watermark = consumer.highwater(tp)
            if watermark is None:  # no fetch answered for this partition yet
                continue
            end = ends.setdefault(tp, watermark)
            records += [
                TopicRecord(tp.partition, record.offset, _decode_or_error(record.value, cls))
                for record in fetched.get(tp, ())
                if record.offset < end
            ]
            if await consumer.position(tp) >= end:
                pending.discard(tp)
    return sorted(records, key=lambda record: (record.partition, record.offset))


def _decode_or_error(value: bytes | None, cls: type[M]) -> M | DecodeError:
    try:
        return decode(value or b"", cls)
    except DecodeError as error:
        return error
