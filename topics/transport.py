"""The message transport every worker talks to, whatever carries the bytes.

A worker sends through one `Outbox` and receives through `Inbox`es; both speak
Messages and topic roles ("prompts"), never broker names or client objects. The
rules every worker used to write by hand live here, once:

- an inbox decodes each record; bytes that do not decode go to `dead-letter` with
  the reason (delivery awaited) and count as processed, and so does a decoded
  message its worker rejects (`Inbox.reject`: a check needing the worker's context);
- a worker marks a delivery `done` once everything it caused is sent; `commit`
  then flushes the outbox and commits, per partition, up to the first delivery
  not yet done, at most once per commit period, so a restarted worker re-reads
  exactly what was still in flight;
- `WeightsFollower` keeps the newest announced weight version its worker accepts.

Two implementations: `topics.kafka.KafkaTransport` (aiokafka, any Kafka-protocol
broker) and `topics.memory.MemoryTransport` (one process, for unit tests of worker
loops). Both go through the same `Inbox` and `Outbox` below; they differ only in
their `RecordSource` and `RecordSink`.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

import msgspec
from opentelemetry import context as otel_context

from schemas.messages import DeadLetter, Message, WeightVersion, encode
from schemas.validate import DecodeError, decode
from topics.names import DEAD_LETTER, TopicLayout
from topics.tracing import context_of_headers

M = TypeVar("M", bound=Message)

SCHEMA_HEADER = "schema"  # the struct's name, so replay tools can decode any topic
COMMIT_PERIOD_S = 0.5  # how often a group inbox commits: often enough to lose little work on a crash

Key = str | int | bytes | None
Headers = Mapping[str, str | bytes]
RawHeaders = list[tuple[str, bytes]]


class RawRecord(msgspec.Struct, kw_only=True):
    """One stored record as the broker gave it, bytes untouched (also the unit of topic exports)."""

    partition: int
    offset: int
    timestamp: int  # milliseconds since the epoch
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


@dataclass(frozen=True)
class Delivery(Generic[M]):
    """A decoded message and where it came from; `Inbox.done(delivery)` once it is fully processed."""

    message: M
    partition: int
    offset: int
    headers: RawHeaders
    value: bytes  # the record's bytes as they came: what `Inbox.reject` dead-letters

    def trace(self) -> otel_context.Context:
        """The trace context its producer sent along (empty if none)."""
        return context_of_headers(self.headers)


class RecordSource(Protocol):
    """What an inbox reads from: one topic, some or all of its partitions."""

    async def fetch(self, timeout_s: float, max_records: int | None) -> list[RawRecord]: ...

    async def commit(self, offsets: dict[int, int]) -> None: ...


class RecordSink(Protocol):
    """What an outbox writes to; `send` returns once the record is queued, its awaitable once delivered."""

    async def send(self, topic: str, value: bytes, key: bytes | None, headers: RawHeaders) -> Awaitable: ...

    async def flush(self) -> None: ...


class Outbox:
    """Keyed sends of Messages to topic roles, with the schema header and any trace headers."""

    def __init__(self, sink: RecordSink, layout: TopicLayout):
        self.sink, self.layout = sink, layout

    async def send(self, role: str, message: Message, *, key: Key = None, headers: Headers | None = None) -> Awaitable:
        """Queue `message` on `role`'s topic (batched with others); await the result for its delivery."""
        return await self.sink.send(
            self.layout.name(role), encode(message), key_bytes(key), record_headers(message, headers)
        )

    async def send_now(self, role: str, message: Message, *, key: Key = None, headers: Headers | None = None) -> None:
        """`send`, then wait until the broker has the record."""
        await (await self.send(role, message, key=key, headers=headers))

    async def dead_letter(self, letter: DeadLetter, headers: Headers | None = None) -> None:
        """Put `letter` on `dead-letter`, keyed by its origin, and wait for its delivery."""
        await self.send_now(DEAD_LETTER, letter, key=letter.origin, headers=headers)

    async def flush(self) -> None:
        await self.sink.flush()


class CommitTracker:
    """Per partition: the offset a worker may commit, i.e. the first one not yet fully processed."""

    def __init__(self) -> None:
        self._in_flight: dict[int, set[int]] = {}
        self._next: dict[int, int] = {}  # one past the highest offset seen
        self._committed: dict[int, int] = {}

    def started(self, partition: int, offset: int) -> None:
        self._in_flight.setdefault(partition, set()).add(offset)
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def finished(self, partition: int, offset: int) -> None:
        self._in_flight.get(partition, set()).discard(offset)  # a forgotten partition's records no longer count

    def forget(self, partitions: set[int]) -> None:
        """Drop partitions taken away by a rebalance: their records go to another worker."""
        for partition in partitions:
            for table in (self._in_flight, self._next, self._committed):
                table.pop(partition, None)

    def to_commit(self) -> dict[int, int]:
        """Per partition, the offset to commit now, where it moved since the last call."""
        offsets = {p: min(self._in_flight.get(p) or {end}) for p, end in self._next.items()}
        changed = {p: o for p, o in offsets.items() if self._committed.get(p) != o}
        self._committed.update(changed)
        return changed


class Inbox(Generic[M]):
    """Decoded deliveries of one topic role; bad bytes to `dead-letter`; commits of what is done."""

    def __init__(
        self,
        source: RecordSource,
        cls: type[M],
        outbox: Outbox,
        *,
        role: str,
        origin: str,
        start_offsets: Mapping[int, int] | None = None,
        max_records: int | None = None,
        commit_period_s: float = COMMIT_PERIOD_S,
        commits: CommitTracker | None = None,
    ):
        self.source, self.cls, self.outbox, self.role, self.origin = source, cls, outbox, role, origin
        self.max_records, self.commit_period_s = max_records, commit_period_s
        self.positions: dict[int, int] = dict(start_offsets or {})  # partition -> next offset to read
        self.commits = commits or CommitTracker()  # given when the source must reach it (rebalances)
        self._last_commit = time.monotonic()

    async def poll(self, timeout_s: float = 0.0) -> list[Delivery[M]]:
        """What arrived (waiting up to `timeout_s` for something); undecodable records are dead-lettered."""
        deliveries = []
        for raw in await self.source.fetch(timeout_s, self.max_records):
            self.positions[raw.partition] = raw.offset + 1
            self.commits.started(raw.partition, raw.offset)
            try:
                message = decode(raw.value or b"", self.cls)  # a null value (tombstone) is not a message
            except DecodeError as error:
                await self._dead_letter(raw, str(error))
                self.commits.finished(raw.partition, raw.offset)
                continue
            deliveries.append(Delivery(message, raw.partition, raw.offset, raw.headers, raw.value or b""))
        return deliveries

    def done(self, delivery: Delivery) -> None:
        """Everything `delivery` caused is sent (or it needed nothing): its offset may be committed."""
        self.commits.finished(delivery.partition, delivery.offset)

    async def reject(self, delivery: Delivery[M], reason: str) -> None:
        """Dead-letter a decoded delivery a worker cannot use (a check of its own context failed), with its
        bytes and the reason; it then counts as processed, like bytes that do not decode."""
        await self._dead_letter(delivery, reason)
        self.done(delivery)

    async def commit(self, *, now: bool = False) -> None:
        """Flush the outbox, then commit what is done; at most once per commit period unless `now`."""
        if not now and time.monotonic() - self._last_commit < self.commit_period_s:
            return
        if offsets := self.commits.to_commit():
            await self.outbox.flush()  # everything sent is on the broker before its cause is committed
            await self.source.commit(offsets)
        self._last_commit = time.monotonic()

    async def _dead_letter(self, raw: RawRecord | Delivery, reason: str) -> None:
        letter = DeadLetter(
            origin=self.origin,
            source=self.outbox.layout.name(self.role),
            reason=reason,
            payload=raw.value or b"",
            partition=raw.partition,
            offset=raw.offset,
        )
        await self.outbox.dead_letter(letter, {name: value for name, value in raw.headers if name != SCHEMA_HEADER})


WeightsCheck = Callable[[Delivery[WeightVersion]], str | None]  # why a worker refuses an announcement, or None


class WeightsFollower:
    """Follows `weights`: the newest announcement seen (by version, then by groups dropped) that `check`
    accepts. `check` (the worker's: signature, file) runs in a thread, newest first, only on what would
    become the newest: an older announcement is superseded unread. A refused one goes to `dead-letter`
    with the reason and the follower keeps what it had."""

    def __init__(self, inbox: Inbox[WeightVersion], check: WeightsCheck | None = None):
        self.inbox, self.check = inbox, check
        self.latest: WeightVersion | None = None

    async def poll(self, timeout_s: float = 0.0) -> WeightVersion | None:
        """Read what was announced since the last call; the newest accepted announcement so far (None before any)."""
        for delivery in sorted(await self.inbox.poll(timeout_s), key=lambda d: _rank(d.message), reverse=True):
            if self.latest is not None and _rank(delivery.message) <= _rank(self.latest):
                self.inbox.done(delivery)
            elif self.check and (problem := await asyncio.to_thread(self.check, delivery)):
                await self.inbox.reject(delivery, problem)
            else:
                self.latest = delivery.message
                self.inbox.done(delivery)
        return self.latest


def _rank(announced: WeightVersion) -> tuple[int, int]:
    """Newer weights first; the same version re-announced with more groups dropped is newer too."""
    return announced.version, announced.groups_dropped


class TopicRecord(NamedTuple):
    partition: int
    offset: int
    message: Message | DecodeError  # the error, for bytes that do not decode


class Transport(abc.ABC):
    """Opens inboxes and outboxes on one run's topics (`layout`); an implementation gives sources and sinks."""

    layout: TopicLayout

    @asynccontextmanager
    async def outbox(self) -> AsyncIterator[Outbox]:
        """An outbox, flushed when the block ends."""
        async with self.sink() as sink:
            yield Outbox(sink, self.layout)
            await sink.flush()

    @asynccontextmanager
    async def inbox(
        self,
        role: str,
        cls: type[M],
        outbox: Outbox,
        *,
        origin: str,
        group: str | None = None,
        alone: bool = False,
        start_offsets: Mapping[int, int] | None = None,
        max_records: int | None = None,
    ) -> AsyncIterator[Inbox[M]]:
        """An inbox of `role`. `group`: share the topic with the other workers of this consumer group,
        starting at the group's committed offsets; with `alone`, the caller is the group's only worker: it reads
        every partition from those offsets without joining the group, and commits to it as a member would.
        None: read every partition alone, from `start_offsets` (partitions not named: from the beginning)."""
        commits = CommitTracker()
        async with self.source(self.layout.name(role), group, start_offsets or {}, commits, alone) as source:
            yield Inbox(
                source,
                cls,
                outbox,
                role=role,
                origin=origin,
                start_offsets=start_offsets,
                max_records=max_records,
                commits=commits,
            )

    def weights_follower(self, outbox: Outbox, *, origin: str) -> AbstractAsyncContextManager[Inbox[WeightVersion]]:
        """An inbox of `weights` from the beginning: wrap it in `WeightsFollower`."""
        return self.inbox("weights", WeightVersion, outbox, origin=origin)

    @abc.abstractmethod
    def sink(self) -> AbstractAsyncContextManager[RecordSink]:
        """Where an outbox's records go."""

    @abc.abstractmethod
    def source(
        self, topic: str, group: str | None, start_offsets: Mapping[int, int], commits: CommitTracker, alone: bool
    ) -> AbstractAsyncContextManager[RecordSource]:
        """Records of `topic` for one inbox (see `inbox`); `commits` forgets partitions a rebalance takes away."""

    @abc.abstractmethod
    async def read_all(self, role: str, cls: type[M]) -> list[TopicRecord]:
        """Every record of `role`'s topic up to its end now, decoded (or the DecodeError), by partition and offset."""


def record_headers(message: Message, headers: Headers | None = None) -> RawHeaders:
    """The headers a message travels with: its struct's name, then `headers` (e.g. the W3C `traceparent`)."""
    extra = [(name, _as_bytes(value)) for name, value in (headers or {}).items()]
    return [(SCHEMA_HEADER, type(message).__name__.encode()), *extra]


def key_bytes(key: Key) -> bytes | None:
    return None if key is None else _as_bytes(key)


def decode_or_error(value: bytes | None, cls: type[M]) -> M | DecodeError:
    try:
        return decode(value or b"", cls)
    except DecodeError as error:
        return error


def _as_bytes(value: str | int | bytes) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()
