"""Read a whole topic, decoded, from the beginning to its end at the time of the call.

The end of each partition is the high watermark of a fetch response (see
topics/inspect.py): never `end_offsets()`, which Tansu answers short once a
produce batch holds several records.
"""

from __future__ import annotations

from topics.inspect import read_records
from topics.transport import M, TopicRecord, decode_or_error


async def read_topic(bootstrap: str, topic: str, cls: type[M], *, timeout_s: float = 60.0) -> list[TopicRecord]:
    """Every record of `topic`, decoded as `cls`, ordered by partition and offset."""
    return [
        TopicRecord(record.partition, record.offset, decode_or_error(record.value, cls))
        for record in await read_records(bootstrap, topic, timeout_s=timeout_s)
    ]
