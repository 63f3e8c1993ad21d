"""The topics package against a real Tansu broker and real aiokafka clients."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRecord

from schemas.messages import (
    BatchManifest,
    DeadLetter,
    DroppedGroup,
    Message,
    PromptGroup,
    Scored,
    Segment,
    WeightVersion,
    encode,
)
from schemas.validate import DecodeError, decode
from tests import factories
from topics.admin import BrokerUnreachable, TopicMismatchError, ensure_topics
from topics.broker import BrokerError, EmbeddedBroker
from topics.clients import (
    assigned_consumer,
    make_producer,
    send,
    send_and_wait,
)
from topics.kafka import KafkaTransport
from topics.names import (
    BATCHES,
    DEAD_LETTER,
    PROMPTS,
    ROLES,
    SCORED,
    SEGMENTS,
    WEIGHTS,
    TopicLayout,
)
from topics.readers import read_topic

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def header(record: ConsumerRecord, name: str) -> str | None:
    return next((value.decode() for key, value in record.headers if key == name), None)


def prompt_group(prompt_id: str = "run/0/0", text: str = "What is 2+2?") -> PromptGroup:
    return PromptGroup(
        prompt_id=prompt_id,
        row_index=0,
        epoch=0,
        release_index=0,
        released_at_version=0,
        prompt_text=text,
        prompt_tokens=[5, 6, 7],
        answer="4",
        metadata={"source": "test"},
        n_samples=2,
    )


def segment(index: int) -> Segment:
    return factories.segment(trajectory_id=f"run/0/0/{index}", token_ids=[index, index + 1], logprobs=[-0.5, -0.25])


def one_of_each() -> dict[str, Message]:
    return {
        PROMPTS: prompt_group(),
        SEGMENTS: msgspec.structs.replace(segment(0), group=prompt_group()),
        SCORED: Scored(
            trajectory_id="run/0/0/0",
            prompt_id="run/0/0",
            sample_index=0,
            n_samples=2,
            release_index=0,
            released_at_version=0,
            attempt="rollout-0:1",
            prompt_tokens=[5, 6, 7],
            completion_tokens=[1, 2],
            logprobs=[-0.5, -0.25],
            versions=[0, 1],
            finish_reason="stop",
            num_segments=2,
            reward=1.0,
            reward_details={"verifier": "math"},
        ),
        WEIGHTS: WeightVersion(
            version=1,
            uri="/w/1.safetensors",
            content_hash="ab" * 32,
            step=1,
            groups_consumed=4,
            groups_dropped=0,
        ),
        BATCHES: BatchManifest(
            step=1,
            trainer_version=0,
            trajectory_ids=["run/0/0/0"],
            scored_offsets=[(0, 0)],
            consumed_offsets=[(0, 1)],
            dropped=[DroppedGroup(prompt_id="run/0/1", reason="stale")],
        ),
        DEAD_LETTER: DeadLetter(origin="reward-0", source="segments", reason="bad", payload=b"\x00"),
    }


async def consume(consumer: AIOKafkaConsumer, count: int) -> list[ConsumerRecord]:
    records: list[ConsumerRecord] = []
    async with asyncio.timeout(20):
        while len(records) < count:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                records += batch
    return records


def accepts_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def assert_reaped(pid: int) -> None:
    with pytest.raises(ChildProcessError):  # no longer our child: waited for
        os.waitpid(pid, os.WNOHANG)
    assert not Path(f"/proc/{pid}").exists()


# --- the embedded broker ------------------------------------------------------


def test_broker_starts_answers_and_stops_leaving_no_process(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    with EmbeddedBroker(log) as broker:
        pid, port = broker.pid, broker.port
        assert pid is not None and broker.running
        assert broker.bootstrap == f"127.0.0.1:{port}"
        assert accepts_connections(port)
    assert not broker.running and broker.exit_code is not None
    assert_reaped(pid)
    assert not accepts_connections(port)
    assert "listening on" in log.read_text()


def test_stop_kills_a_broker_that_ignores_sigterm(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path / "broker.log", stop_timeout_s=0.3).start()
    assert broker.pid is not None
    os.kill(broker.pid, signal.SIGSTOP)  # a stopped process does not act on SIGTERM
    broker.stop()
    assert broker.exit_code == -signal.SIGKILL
    assert_reaped(broker.pid)


def test_a_broker_that_fails_to_start_reports_its_log(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path / "broker.log", storage_engine="postgres://nobody@localhost/")
    with pytest.raises(BrokerError, match=r"(?s)exited with code 1.*postgres"):
        broker.start()
    assert broker.pid is not None
    assert_reaped(broker.pid)


def test_a_busy_port_is_refused(broker: EmbeddedBroker, tmp_path: Path) -> None:
    with pytest.raises(BrokerError, match="already in use"):
        EmbeddedBroker(tmp_path / "broker.log", port=broker.port).start()


@pytest.mark.timeout(30)
def test_serve_forever_prints_the_address_and_stops_on_sigterm(tmp_path: Path) -> None:
    code = "import sys; from topics.broker import serve_forever; serve_forever(None, sys.argv[1])"
    command = [sys.executable, "-c", code, str(tmp_path / "broker.log")]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as cli:
        try:
            port = int(cli.stdout.readline().rsplit(":", 1)[1])
            assert accepts_connections(port)
            cli.send_signal(signal.SIGTERM)
            assert cli.wait(timeout=10) == 0, cli.stderr.read()
        finally:
            cli.kill()  # a no-op once it has exited; the with block reaps it
    assert not accepts_connections(port)


# --- topic names and administration ------------------------------------------


def test_layout_applies_prefix_partitions_and_message_types() -> None:
    layout = TopicLayout(prefix="run7.", partitions=4)
    assert layout.name(PROMPTS) == "run7.prompts"
    assert layout.spec(SCORED).partitions == 4
    assert layout.spec(WEIGHTS).partitions == 1
    assert layout.spec(DEAD_LETTER).message is DeadLetter
    assert layout.role_of("run7.batches") == BATCHES
    assert layout.role_of("batches") is None
    assert TopicLayout().names == ROLES
    assert TopicLayout(partitions={SEGMENTS: 3}).partitions == {**dict.fromkeys(ROLES, 1), SEGMENTS: 3}


@pytest.mark.parametrize("partitions", [{WEIGHTS: 2}, {"prompt": 2}, {SCORED: 0}, 0])
def test_layout_rejects_bad_partition_counts(partitions: int | dict[str, int]) -> None:
    with pytest.raises(ValueError):
        TopicLayout(partitions=partitions)


async def test_ensure_topics_is_idempotent_and_refuses_another_partition_count(
    broker: EmbeddedBroker, unique_name: Callable[[str], str]
) -> None:
    layout = TopicLayout(prefix=unique_name("run") + ".", partitions={PROMPTS: 3})
    await ensure_topics(broker.bootstrap, layout.names, layout.partitions)
    await ensure_topics(broker.bootstrap, layout.names, layout.partitions)
    async with assigned_consumer(broker.bootstrap, layout.name(PROMPTS)) as consumer:
        assert len(consumer.assignment()) == 3
    with pytest.raises(TopicMismatchError, match="exists with 3 partitions"):
        await ensure_topics(broker.bootstrap, [layout.name(PROMPTS)], 2)


# --- producing and consuming ---------------------------------------------------


async def test_every_message_type_round_trips_with_key_and_headers(
    broker: EmbeddedBroker, topic_layout: TopicLayout
) -> None:
    messages = one_of_each()
    async with make_producer(broker.bootstrap) as producer:
        for role, message in messages.items():
            key = 7 if role == BATCHES else f"key-{role}"
            await send_and_wait(
                producer, topic_layout.name(role), message, key=key,
                headers={"traceparent": TRACEPARENT},
            )  # fmt: skip
    for role, message in messages.items():
        async with assigned_consumer(broker.bootstrap, topic_layout.name(role)) as consumer:
            (record,) = await consume(consumer, 1)
        assert decode(record.value, topic_layout.spec(role).message) == message
        assert header(record, "schema") == type(message).__name__
        assert header(record, "traceparent") == TRACEPARENT
        assert record.key == (b"7" if role == BATCHES else f"key-{role}".encode())


async def test_read_topic_reaches_the_true_end_of_multi_record_batches(
    broker: EmbeddedBroker, unique_name: Callable[[str], str]
) -> None:
    topic, count = unique_name("segments"), 60
    await ensure_topics(broker.bootstrap, [topic], 2)
    garbage = b"\xc1 not msgpack"
    async with make_producer(broker.bootstrap) as producer:
        await producer.send_and_wait(topic, garbage, partition=0)
        deliveries = [await send(producer, topic, segment(i), key=f"t{i}") for i in range(count)]
        await producer.flush()
        partitions = {(await delivery).partition for delivery in deliveries}
    assert partitions == {0, 1}
    async with assigned_consumer(broker.bootstrap, topic) as consumer:
        listed_ends = await consumer.end_offsets(list(consumer.assignment()))
    assert sum(listed_ends.values()) < count + 1, (
        "precondition: Tansu's ListOffsets is short after multi-record batches; "
        "if a new broker fixed it, this test no longer exercises the gap"
    )

    records = await read_topic(broker.bootstrap, topic, Segment)

    assert len(records) == count + 1
    for partition in (0, 1):
        offsets = [record.offset for record in records if record.partition == partition]
        assert offsets == list(range(len(offsets)))
    assert isinstance(records[0].message, DecodeError)
    decoded = {record.message.trajectory_id: record.message for record in records[1:]}
    assert decoded == {segment(i).trajectory_id: segment(i) for i in range(count)}


async def test_read_topic_of_an_empty_topic_and_of_a_missing_one(
    broker: EmbeddedBroker, unique_name: Callable[[str], str]
) -> None:
    empty, missing = unique_name("empty"), unique_name("missing")
    await ensure_topics(broker.bootstrap, [empty], 3)
    assert await read_topic(broker.bootstrap, empty, Segment, timeout_s=10) == []
    with pytest.raises(LookupError):
        await read_topic(broker.bootstrap, missing, Segment)
    async with assigned_consumer(broker.bootstrap, empty) as consumer:
        assert missing not in await consumer.topics()  # asking did not create it


async def test_assigned_consumer_starts_at_the_given_offsets(
    broker: EmbeddedBroker, unique_name: Callable[[str], str]
) -> None:
    topic = unique_name("scored")
    await ensure_topics(broker.bootstrap, [topic], 2)
    async with make_producer(broker.bootstrap) as producer:
        for partition, count in ((0, 5), (1, 3)):
            for i in range(count):
                await producer.send(topic, encode(segment(i)), partition=partition)
        await producer.flush()
    async with assigned_consumer(broker.bootstrap, topic, {0: 3}) as consumer:
        records = await consume(consumer, 5)
    assert sorted((r.partition, r.offset) for r in records) == [(0, 3), (0, 4), (1, 0), (1, 1), (1, 2)]
    with pytest.raises(ValueError, match="no partitions"):
        async with assigned_consumer(broker.bootstrap, topic, {2: 0}):
            pass


async def test_malformed_bytes_go_to_dead_letter_and_the_worker_goes_on(
    broker: EmbeddedBroker, topic_layout: TopicLayout
) -> None:
    prompts, dead_letter = topic_layout.name(PROMPTS), topic_layout.name(DEAD_LETTER)
    garbage = b"\xc1 not msgpack"
    from_the_future = encode(msgspec.structs.replace(prompt_group(), schema_version=99))
    trace = [("traceparent", TRACEPARENT.encode())]
    async with make_producer(broker.bootstrap) as producer:
        for value in (garbage, from_the_future, encode(prompt_group())):
            await producer.send(prompts, value, headers=trace)
        await producer.flush()
    transport = KafkaTransport(broker.bootstrap, topic_layout, fetch_wait_ms=20)
    async with transport.outbox() as outbox, transport.inbox(PROMPTS, PromptGroup, outbox, origin="rollout-0") as inbox:
        decoded = []
        for _ in range(100):
            decoded += await inbox.poll(0.1)
            if decoded:
                break
        assert inbox.positions == {0: 3}  # the bad records count as read
    assert [d.message for d in decoded] == [prompt_group()] and decoded[0].offset == 2

    async with assigned_consumer(broker.bootstrap, dead_letter) as consumer:
        letters = await consume(consumer, 2)
    first, second = (decode(letter.value, DeadLetter) for letter in letters)
    assert (first.payload, second.payload) == (garbage, from_the_future)
    assert "not a valid PromptGroup" in first.reason
    assert "schema_version 99" in second.reason
    assert [(d.origin, d.source, d.partition, d.offset) for d in (first, second)] == [
        ("rollout-0", prompts, 0, 0),
        ("rollout-0", prompts, 0, 1),
    ]
    assert all(header(letter, "schema") == "DeadLetter" for letter in letters)
    assert all(header(letter, "traceparent") == TRACEPARENT for letter in letters)
    assert letters[0].key == b"rollout-0"


async def test_a_message_over_1_mib_round_trips(broker: EmbeddedBroker, unique_name: Callable[[str], str]) -> None:
    topic = unique_name("prompts")
    await ensure_topics(broker.bootstrap, [topic], 1)
    big = msgspec.structs.replace(prompt_group(text="x" * (3 << 20)), prompt_tokens=list(range(300_000)))
    async with make_producer(broker.bootstrap) as producer:
        await send_and_wait(producer, topic, big)
    async with assigned_consumer(broker.bootstrap, topic) as consumer:
        (record,) = await consume(consumer, 1)
    assert len(record.value) > 3 << 20
    assert decode(record.value, PromptGroup) == big


async def test_no_broker_at_the_address_is_named_not_a_traceback() -> None:
    with socket.socket() as closed:  # a port nothing listens on: bound, never listening
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(BrokerUnreachable, match=f"no broker answers at {address}"):
            await ensure_topics(address, ["prompts"])
