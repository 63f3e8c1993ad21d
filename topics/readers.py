"""Read a whole topic, decoded, from the beginning to its end at the time of the call.

The end of each partition is the high watermark of a fetch response (see
topics/inspect.py): never `end_offsets()`, which Tansu answers short once a
produce batch holds several records.
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

from schemas.messages import DecodeError, Message, decode
from topics.inspect import read_records

M = TypeVar("M", bound=Message)


class TopicRecord(NamedTuple):
    partition: int
    offset: int
    message: Message | DecodeError  # the error, for bytes that do not decode


async def read_topic(bootstrap: str, topic: str, cls: type[M], *, timeout_s: float = 60.0) -> list[TopicRecord]:
    """Every record of `topic`, decoded as `cls`, ordered by partition and offset."""
    return [
        TopicRecord(record.partition, record.offset, _decode_or_error(record.value, cls))
        for record in await read_records(bootstrap, topic, timeout_s=timeout_s)
    ]


def _decode_or_error(value: bytes | None, cls: type[M]) -> M | DecodeError:
    try:
        return decode(value or b"", cls)
    except DecodeError as error:
        return error
