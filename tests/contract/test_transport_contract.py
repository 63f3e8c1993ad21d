"""What every transport promises, run against each one: the in-memory one and Kafka on the real broker.

A worker written against `topics.transport` behaves the same on either; these
cases pin the part of that behaviour the workers rely on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from schemas.messages import DeadLetter, PromptGroup, WeightVersion
from topics.admin import ensure_topics
from topics.kafka import KafkaTransport
from topics.memory import MemoryTransport
from topics.names import TopicLayout
from topics.tracing import trace_headers
from topics.transport import Inbox, Transport, WeightsFollower

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def group(n: int) -> PromptGroup:
    return PromptGroup(
        prompt_id=f"p{n}",
        row_index=n,
        epoch=0,
        release_index=n,
        released_at_version=0,
        prompt_text="1+1=",
        prompt_tokens=[1, 2],
        answer="2",
        n_samples=2,
    )


def version(v: int, dropped: int = 0) -> WeightVersion:
    return WeightVersion(
        version=v, uri=f"/w/{v}", content_hash="ab" * 32, step=v, groups_consumed=0, groups_dropped=dropped
    )


@pytest.fixture(params=["memory", "kafka"])
async def transport(request, unique_name) -> AsyncIterator[Transport]:
    layout = TopicLayout(prefix=unique_name("run") + ".", partitions=2)
    if request.param == "memory":
        yield MemoryTransport(layout)
        return
    broker = request.getfixturevalue("broker")
    await ensure_topics(broker.bootstrap, layout.names, layout.partitions)
    yield KafkaTransport(broker.bootstrap, layout, fetch_wait_ms=20)


async def poll_until(inbox: Inbox, count: int, timeout_s: float = 20) -> list:
    got: list = []
    for _ in range(int(timeout_s / 0.1)):
        got += await inbox.poll(0.1)
        if len(got) >= count:
            return got
    raise AssertionError(f"{len(got)} of {count} deliveries arrived")


async def raw_send(transport: Transport, role: str, value: bytes, key: bytes) -> None:
    """Bytes that are no message, as a broken producer would write them."""
    if isinstance(transport, MemoryTransport):
        await transport.broker.append(transport.layout.name(role), value, key, [])
        return
    from topics.clients import make_producer

    async with make_producer(transport.bootstrap) as producer:
        await producer.send_and_wait(transport.layout.name(role), value, key=key)


async def test_messages_arrive_decoded_with_their_trace_and_bad_bytes_go_to_dead_letter(transport):
    async with transport.outbox() as outbox:
        await outbox.send_now("prompts", group(0), key="p0", headers={"traceparent": TRACEPARENT})
        await raw_send(transport, "prompts", b"\xc1 garbage", b"p0")  # same key: same partition, after p0
        await outbox.send_now("prompts", group(1), key="p0")
        async with transport.inbox("prompts", PromptGroup, outbox, origin="tester") as inbox:
            deliveries = await poll_until(inbox, 2)
    assert [d.message for d in deliveries] == [group(0), group(1)]
    assert deliveries[1].offset == deliveries[0].offset + 2 and deliveries[0].partition == deliveries[1].partition
    assert trace_headers() == {}  # nothing sampled here; the context still came through:
    assert deliveries[0].trace() != deliveries[1].trace()
    letters = [r.message for r in await transport.read_all("dead-letter", DeadLetter)]
    assert len(letters) == 1 and letters[0].payload == b"\xc1 garbage" and letters[0].origin == "tester"
    assert letters[0].source == transport.layout.name("prompts") and "not a valid PromptGroup" in letters[0].reason


@pytest.mark.slow  # on Kafka: two group joins, ~20 s on Tansu
async def test_a_group_inbox_restarts_after_what_was_done_and_committed(transport):
    async with transport.outbox() as outbox:
        for n in range(3):
            await outbox.send_now("prompts", group(n), key="same")
        async with transport.inbox("prompts", PromptGroup, outbox, origin="a", group="rollout") as inbox:
            first = await poll_until(inbox, 3)
            inbox.done(first[0])
            inbox.done(first[2])  # 1 is still in flight: the commit stops before it
            await inbox.commit(now=True)
        async with transport.inbox("prompts", PromptGroup, outbox, origin="b", group="rollout") as inbox:
            again = await poll_until(inbox, 2)
    assert [d.message.prompt_id for d in again] == ["p1", "p2"]


@pytest.mark.slow  # on Kafka: one group join, ~3-6 s on Tansu
async def test_a_group_s_only_worker_reads_without_joining_and_commits_to_the_group(transport):
    async with transport.outbox() as outbox:
        for n in range(4):
            await outbox.send_now("prompts", group(n), key=f"k{n}")  # over both partitions
        async with transport.inbox("prompts", PromptGroup, outbox, origin="a", group="rollout", alone=True) as inbox:
            first = await poll_until(inbox, 4)
            for delivery in first:
                if delivery.message.prompt_id != "p3":  # the last record of its partition: left undone
                    inbox.done(delivery)
            await inbox.commit(now=True)
        await outbox.send_now("prompts", group(4), key="k4")
        async with transport.inbox("prompts", PromptGroup, outbox, origin="b", group="rollout", alone=True) as inbox:
            restarted = await poll_until(inbox, 2)  # a lone worker restarted: where the last one committed
            await asyncio.sleep(0.2)
            restarted += await inbox.poll(0)
        async with transport.inbox("prompts", PromptGroup, outbox, origin="c", group="rollout") as inbox:
            again = await poll_until(inbox, 2)  # a member that joins starts there too
            await asyncio.sleep(0.2)
            again += await inbox.poll(0)
    assert {r.partition for r in await transport.read_all("prompts", PromptGroup)} == {0, 1}
    assert sorted(d.message.prompt_id for d in first) == ["p0", "p1", "p2", "p3"]
    assert sorted(d.message.prompt_id for d in restarted) == sorted(d.message.prompt_id for d in again) == ["p3", "p4"]


async def test_a_reader_starts_where_told_and_read_all_sees_every_record(transport):
    async with transport.outbox() as outbox:
        for n in range(4):
            await outbox.send_now("prompts", group(n), key="same")
        records = await transport.read_all("prompts", PromptGroup)
        partition = records[0].partition
        async with transport.inbox("prompts", PromptGroup, outbox, origin="t", start_offsets={partition: 2}) as inbox:
            tail = await poll_until(inbox, 2)
            await asyncio.sleep(0.2)
            assert await inbox.poll(0) == []
    assert [r.message for r in records] == [group(n) for n in range(4)]
    assert [d.message for d in tail] == [group(2), group(3)] and inbox.positions == {partition: 4}


async def test_the_weights_follower_keeps_the_newest_announcement(transport):
    async with transport.outbox() as outbox, transport.weights_follower(outbox, origin="t") as inbox:
        follower = WeightsFollower(inbox)
        assert await follower.poll() is None
        for announced in (version(1), version(3), version(2), version(3, dropped=1)):
            await outbox.send_now("weights", announced)
        for _ in range(100):
            if await follower.poll(0.1) == version(3, dropped=1):
                break
    assert follower.latest == version(3, dropped=1)  # an older re-announcement (a restarted trainer) never wins
