"""Topic administration: create the run's topics before any client touches them; read and set the committed
offsets of its consumer groups (an export keeps them, an import puts them back)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError, for_code

from topics.clients import MAX_MESSAGE_BYTES, assigned_consumer


class TopicMismatchError(RuntimeError):
    """A topic exists with another partition count than the run needs."""


class BrokerUnreachable(ConnectionError):
    """No broker answers at the bootstrap address."""


async def ensure_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int | Mapping[str, int] = 1,
    *,
    replication_factor: int = 1,
) -> None:
    """Create the topics that are missing; check the partition count of all of them.

    Partitions cannot be added later (Tansu has no CreatePartitions), so an
    existing topic with another count is an error, not something to repair.
    """
    wanted = {name: partitions if isinstance(partitions, int) else partitions[name] for name in names}
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
    except KafkaConnectionError:
        raise BrokerUnreachable(f"no broker answers at {bootstrap}") from None
    try:
        response = await admin.create_topics(
            [
                NewTopic(
                    name,
                    count,
                    replication_factor,
                    topic_configs={"max.message.bytes": str(MAX_MESSAGE_BYTES)},
                )
                for name, count in wanted.items()
            ]
        )
        # aiokafka returns per-topic error codes instead of raising.
        for name, error_code, *detail in response.topic_errors:  # v0 has no message
            error = for_code(error_code)
            if error_code and error is not TopicAlreadyExistsError:
                raise error(f"cannot create topic {name!r}: {detail}")
        described = await _describe_when_ready(admin, list(wanted))
    finally:
        await admin.close()
    for topic in described:
        found = len(topic["partitions"])
        if found != wanted[topic["topic"]]:
            raise TopicMismatchError(
                f"topic {topic['topic']!r} exists with {found} partitions, the run needs "
                f"{wanted[topic['topic']]}; delete it or use another topic prefix"
            )


async def _describe_when_ready(
    admin: AIOKafkaAdminClient, names: list[str], *, attempts: int = 50
) -> list[dict[str, Any]]:
    # On a Kafka cluster a new topic can take a moment to reach every broker's metadata.
    for _ in range(attempts):
        described = await admin.describe_topics(names)
        if all(topic["error_code"] == 0 and topic["partitions"] for topic in described):
            return described
        await asyncio.sleep(0.2)
    raise TimeoutError(f"topics {names} are still not ready in the broker's metadata")


async def committed_offsets(bootstrap: str, group_id: str, topic: str) -> dict[int, int]:
    """A consumer group's committed offset per partition of `topic` (partitions it never committed are left
    out), asked without joining the group."""
    async with assigned_consumer(bootstrap, topic, group_id=group_id) as consumer:
        found = {tp.partition: await consumer.committed(tp) for tp in consumer.assignment()}
    return {partition: offset for partition, offset in sorted(found.items()) if offset is not None}


async def commit_offsets(bootstrap: str, group_id: str, topic: str, offsets: Mapping[int, int]) -> None:
    """Commit `offsets` (partition -> offset) for a consumer group that has no member now, as its members
    would have: they start there when they join."""
    if offsets:
        async with assigned_consumer(bootstrap, topic, group_id=group_id) as consumer:
            await consumer.commit({TopicPartition(topic, partition): offset for partition, offset in offsets.items()})
