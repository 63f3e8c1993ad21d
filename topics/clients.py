"""aiokafka producers and consumers configured the same way for every worker.

Settings that hold on Apache Kafka and on Tansu alike: no idempotent or
transactional producer (Tansu has no InitProducerId; the pipeline deduplicates
by id instead), manual commits only, and size limits raised so that large
messages pass. Create clients inside a coroutine (aiokafka binds them to the
running loop) and only after `ensure_topics`: Tansu silently creates any topic
a client asks metadata for, with four partitions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.structs import RecordMetadata

from schemas.messages import Message, encode
from topics.transport import Headers, Key, key_bytes, record_headers

# The largest record a client sends or accepts (a topic's max.message.bytes too).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_FETCH_LIMITS: dict[str, Any] = {
    "fetch_max_bytes": MAX_MESSAGE_BYTES,
    "max_partition_fetch_bytes": MAX_MESSAGE_BYTES,
    # A fetch the broker holds open for new data may be answered only at this
    # deadline (Tansu does so), which adds up hop after hop on the critical path of
    # a synchronous step. 20 ms costs ~50 idle fetches per second per consumer
    # (measured: 7 idle consumers, 0.1 core of Tansu plus 0.09 of clients);
    # workers pass their own (`broker.fetch_wait_ms`).
    "fetch_max_wait_ms": 20,
}


def make_producer(bootstrap: str, **overrides: Any) -> AIOKafkaProducer:
    """A producer (not started: use `async with`) that waits for acks=all."""
    settings: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "acks": "all",
        "enable_idempotence": False,
        "max_request_size": MAX_MESSAGE_BYTES,
    }
    return AIOKafkaProducer(**(settings | overrides))


async def send(
    producer: AIOKafkaProducer,
    topic: str,
    message: Message,
    *,
    key: Key = None,
    headers: Headers | None = None,
) -> asyncio.Future[RecordMetadata]:
    """Queue `message`; await the returned future for its delivery.

    Queueing many before awaiting lets the producer put them in one batch.
    The struct's name travels in the `schema` header, next to `headers`
    (e.g. the W3C `traceparent`).
    """
    return await producer.send(
        topic, encode(message), key=key_bytes(key), headers=list(record_headers(message, headers))
    )


async def send_and_wait(
    producer: AIOKafkaProducer,
    topic: str,
    message: Message,
    *,
    key: Key = None,
    headers: Headers | None = None,
) -> RecordMetadata:
    """`send`, then wait until the broker has the record."""
    return await (await send(producer, topic, message, key=key, headers=headers))


def make_group_consumer(
    bootstrap: str, topic: str, group_id: str, listener: ConsumerRebalanceListener | None = None, **overrides: Any
) -> AIOKafkaConsumer:
    """A consumer (not started: use `async with`) sharing `topic` with its group.

    For roles whose workers come and go. Nothing is committed unless the
    worker calls `commit()`; a group with no commit starts at the beginning.
    Joining a group takes seconds: half the session timeout on Tansu (measured: 5.0 s at
    aiokafka's default 10 s, 3.0 s at the 6 s set here, a worker's start that many seconds
    shorter); Apache Kafka waits group.initial.rebalance.delay.ms (3 s by default) instead.
    A member is given up after the session timeout without a heartbeat, which aiokafka
    sends from the event loop every 2 s: a worker never blocks its loop for that long.
    `listener` hears of partitions taken away or given by a rebalance.
    """
    settings: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "group_id": group_id,
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 2000,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        **_FETCH_LIMITS,
    }
    consumer = AIOKafkaConsumer(**(settings | overrides))
    consumer.subscribe([topic], listener=listener)
    return consumer


@asynccontextmanager
async def assigned_consumer(
    bootstrap: str,
    topic: str,
    start_offsets: Mapping[int, int] | None = None,
    **overrides: Any,
) -> AsyncIterator[AIOKafkaConsumer]:
    """A consumer of every partition of `topic`, in no group, started and positioned.

    For a single reader (the trainer, replay): no group join to wait for.
    Partitions in `start_offsets` start at the offset given, the others at the
    beginning. No silent rewind: on Apache Kafka a position past the end raises
    OffsetOutOfRangeError on fetch (Tansu returns nothing there). Raises
    LookupError if `topic` does not exist.
    """
    settings: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "enable_auto_commit": False,
        "auto_offset_reset": "none",
        **_FETCH_LIMITS,
    }
    consumer = AIOKafkaConsumer(**(settings | overrides))
    try:  # a start that fails (no broker) is stopped too: no client left open
        await consumer.start()
        partitions = [TopicPartition(topic, p) for p in await _partitions_of(consumer, topic)]
        offsets = dict(start_offsets or {})
        unknown = set(offsets) - {tp.partition for tp in partitions}
        if unknown:
            raise ValueError(f"topic {topic!r} has no partitions {sorted(unknown)}")
        consumer.assign(partitions)
        for tp in partitions:
            if tp.partition in offsets:
                consumer.seek(tp, offsets[tp.partition])
        from_beginning = [tp for tp in partitions if tp.partition not in offsets]
        if from_beginning:
            await consumer.seek_to_beginning(*from_beginning)
        yield consumer
    finally:
        await consumer.stop()


async def _partitions_of(consumer: AIOKafkaConsumer, topic: str) -> list[int]:
    # Listing all topics names none, so Tansu creates nothing by accident.
    if topic not in await consumer.topics():
        raise LookupError(f"topic {topic!r} does not exist (run ensure_topics first)")
    return sorted(consumer.partitions_for_topic(topic) or ())
