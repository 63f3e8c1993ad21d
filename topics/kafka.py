"""The transport on a Kafka-protocol broker (Apache Kafka, Tansu, ...) through aiokafka.

Group inboxes share a topic with their consumer group (`<prefix><group>`) and
forget partitions a rebalance takes away, so no commit is sent for them; other
inboxes read every partition alone from given offsets. Whole-topic reads stop at
the high watermark of a fetch (see topics/inspect.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition

from topics.admin import committed_offsets
from topics.clients import assigned_consumer, make_group_consumer, make_producer
from topics.inspect import raw_record
from topics.names import TopicLayout
from topics.readers import read_topic
from topics.transport import (
    CommitTracker,
    M,
    RawHeaders,
    RawRecord,
    TopicRecord,
    Transport,
)

logging.getLogger("aiokafka").setLevel(logging.WARNING)  # its INFO lines (joins, rebalances) drown a worker's log


class ProducerSink:
    def __init__(self, producer: AIOKafkaProducer):
        self.producer = producer

    async def send(self, topic: str, value: bytes, key: bytes | None, headers: RawHeaders) -> Awaitable:
        return await self.producer.send(topic, value, key=key, headers=headers)

    async def flush(self) -> None:
        await self.producer.flush()


class ConsumerSource:
    """One topic's records from an aiokafka consumer; `grouped`: its offsets are committed to a consumer group
    (a member's, or a lone worker's reading by assignment), else nothing is committed."""

    def __init__(self, consumer: AIOKafkaConsumer, topic: str, grouped: bool):
        self.consumer, self.topic, self.grouped = consumer, topic, grouped

    async def fetch(self, timeout_s: float, max_records: int | None) -> list[RawRecord]:
        batches = await self.consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        return [raw_record(r) for records in batches.values() for r in records]

    async def commit(self, offsets: dict[int, int]) -> None:
        if self.grouped:
            await self.consumer.commit({TopicPartition(self.topic, p): o for p, o in offsets.items()})


class ForgetRevoked(ConsumerRebalanceListener):
    """Partitions a rebalance takes away go to another worker: no commit may be sent for them."""

    def __init__(self, tracker: CommitTracker):
        self.tracker = tracker

    def on_partitions_revoked(self, revoked) -> None:
        self.tracker.forget({tp.partition for tp in revoked})

    def on_partitions_assigned(self, assigned) -> None:
        pass


class KafkaTransport(Transport):
    def __init__(self, bootstrap: str, layout: TopicLayout, fetch_wait_ms: int = 200):
        """`fetch_wait_ms`: how long a fetch waits at the broker for new records (`broker.fetch_wait_ms`)."""
        self.bootstrap, self.layout, self.fetch_wait_ms = bootstrap, layout, fetch_wait_ms

    @asynccontextmanager
    async def sink(self) -> AsyncIterator[ProducerSink]:
        async with make_producer(self.bootstrap, linger_ms=5) as producer:
            yield ProducerSink(producer)

    @asynccontextmanager
    async def source(
        self, topic: str, group: str | None, start_offsets: Mapping[int, int], commits: CommitTracker, alone: bool
    ) -> AsyncIterator[ConsumerSource]:
        wait = {"fetch_max_wait_ms": self.fetch_wait_ms}
        if group is None:
            async with assigned_consumer(self.bootstrap, topic, start_offsets, **wait) as consumer:
                yield ConsumerSource(consumer, topic, grouped=False)
            return
        group_id = self.layout.prefix + group
        if alone:  # no join to wait for (3 s on Tansu, make_group_consumer); commits go to the group all the same
            committed = await committed_offsets(self.bootstrap, group_id, topic)
            member = {"group_id": group_id, "auto_offset_reset": "earliest"}  # a commit out of range: as a member
            async with assigned_consumer(self.bootstrap, topic, committed, **member, **wait) as consumer:
                yield ConsumerSource(consumer, topic, grouped=True)
            return
        async with make_group_consumer(self.bootstrap, topic, group_id, ForgetRevoked(commits), **wait) as consumer:
            yield ConsumerSource(consumer, topic, grouped=True)

    async def read_all(self, role: str, cls: type[M]) -> list[TopicRecord]:
        return await read_topic(self.bootstrap, self.layout.name(role), cls)
