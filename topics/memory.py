"""The transport in one process's memory: for fast unit tests of worker loops, and for every role run in one
process (`asyncrl run --in-process`), never between processes.

Same `Inbox`/`Outbox` as the Kafka transport; records are kept per topic and
partition (a key always lands on the same partition), every send is delivered
at once, and a consumer group has one member that owns every partition and starts
at the group's committed offsets, so a test can stop a worker and start another
one where the first left off. Integration and e2e tests of worker processes use the real broker.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager

from topics.names import TopicLayout
from topics.transport import (
    CommitTracker,
    M,
    RawHeaders,
    RawRecord,
    TopicRecord,
    Transport,
    decode_or_error,
)


class MemoryBroker:
    """Topics as lists of records per partition, and committed offsets per consumer group."""

    def __init__(self, layout: TopicLayout):
        self.layout = layout
        self.records: dict[str, list[list[RawRecord]]] = {
            s.name: [[] for _ in range(s.partitions)] for s in layout.specs
        }
        self.committed: dict[tuple[str, str], dict[int, int]] = {}  # (group, topic) -> partition -> offset
        self.arrived = asyncio.Condition()

    async def append(self, topic: str, value: bytes | None, key: bytes | None, headers: RawHeaders) -> RawRecord:
        partitions = self.records[topic]
        index = zlib.crc32(key) % len(partitions) if key is not None else 0
        record = RawRecord(
            partition=index,
            offset=len(partitions[index]),
            timestamp=int(time.time() * 1000),
            key=key,
            value=value,
            headers=list(headers),
        )
        partitions[index].append(record)
        async with self.arrived:
            self.arrived.notify_all()
        return record

    def messages(self, role: str, cls: type[M]) -> list[M]:
        """What `role`'s topic holds that decodes as `cls`, by partition and offset: for test assertions."""
        decoded = [decode_or_error(r.value, cls) for p in self.records[self.layout.name(role)] for r in p]
        return [m for m in decoded if isinstance(m, cls)]


class MemorySink:
    def __init__(self, broker: MemoryBroker):
        self.broker = broker

    async def send(self, topic: str, value: bytes, key: bytes | None, headers: RawHeaders) -> Awaitable:
        delivered = asyncio.get_running_loop().create_future()
        delivered.set_result(await self.broker.append(topic, value, key, headers))
        return delivered

    async def flush(self) -> None:
        pass


class MemorySource:
    def __init__(self, broker: MemoryBroker, topic: str, start: Mapping[int, int], group: str | None):
        self.broker, self.topic, self.group = broker, topic, group
        self.next = {p: start.get(p, 0) for p in range(len(broker.records[topic]))}

    async def fetch(self, timeout_s: float, max_records: int | None) -> list[RawRecord]:
        if not self._pending() and timeout_s > 0:
            async with self.broker.arrived:
                try:
                    await asyncio.wait_for(self.broker.arrived.wait_for(self._pending), timeout_s)
                except TimeoutError:
                    return []
        out = self._pending()[:max_records]
        for record in out:
            self.next[record.partition] = record.offset + 1
        return out

    async def commit(self, offsets: dict[int, int]) -> None:
        if self.group is not None:
            self.broker.committed.setdefault((self.group, self.topic), {}).update(offsets)

    def _pending(self) -> list[RawRecord]:
        partitions = self.broker.records[self.topic]
        return [r for p, records in enumerate(partitions) for r in records[self.next[p] :]]


class MemoryTransport(Transport):
    def __init__(self, layout: TopicLayout | None = None, broker: MemoryBroker | None = None):
        self.layout = layout or (broker.layout if broker else TopicLayout())
        self.broker = broker or MemoryBroker(self.layout)

    @asynccontextmanager
    async def sink(self) -> AsyncIterator[MemorySink]:
        yield MemorySink(self.broker)

    @asynccontextmanager
    async def source(
        self, topic: str, group: str | None, start_offsets: Mapping[int, int], commits: CommitTracker, alone: bool
    ) -> AsyncIterator[MemorySource]:  # a group's inbox reads every partition here, `alone` or not
        yield MemorySource(
            self.broker, topic, self.broker.committed.get((group, topic), {}) if group else start_offsets, group
        )

    async def read_all(self, role: str, cls: type[M]) -> list[TopicRecord]:
        records = [r for p in self.broker.records[self.layout.name(role)] for r in p]
        return [TopicRecord(r.partition, r.offset, decode_or_error(r.value, cls)) for r in records]
