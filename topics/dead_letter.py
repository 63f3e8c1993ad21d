"""Bad input never stops a worker: what cannot be decoded goes to `dead-letter`."""

from __future__ import annotations

from typing import TypeVar

from aiokafka import AIOKafkaProducer, ConsumerRecord
from aiokafka.structs import RecordMetadata

from schemas.messages import DeadLetter, DecodeError, Message, decode
from topics.clients import SCHEMA_HEADER, Headers, send_and_wait

M = TypeVar("M", bound=Message)


async def send_dead_letter(
    producer: AIOKafkaProducer,
    topic: str,
    letter: DeadLetter,
    headers: Headers | None = None,
) -> RecordMetadata:
    """Deliver `letter` to the dead-letter `topic`, keyed by its origin."""
    return await send_and_wait(producer, topic, letter, key=letter.origin, headers=headers)


async def decode_or_dead_letter(
    record: ConsumerRecord,
    cls: type[M],
    producer: AIOKafkaProducer,
    *,
    dead_letter_topic: str,
    origin: str,
) -> M | None:
    """The record's message, or None once its bytes are safely on `dead_letter_topic`.

    Waits for the dead letter's delivery, so a worker that commits after this
    call never loses the bad bytes. The record's own headers (trace context)
    travel along.
    """
    try:
        return decode(record.value or b"", cls)  # a null value (tombstone) is not a message
    except DecodeError as error:
        letter = DeadLetter(
            origin=origin,
            source=record.topic,
            reason=str(error),
            payload=record.value or b"",
            partition=record.partition,
            offset=record.offset,
        )
        headers = {name: value for name, value in record.headers if name != SCHEMA_HEADER}
        await send_dead_letter(producer, dead_letter_topic, letter, headers)
        return None
