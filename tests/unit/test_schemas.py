"""Every topic message round-trips exactly; malformed bytes are rejected with a clear error."""

import msgspec
import pytest
from message_examples import GROUP, VALID, WEIGHTS

from schemas.messages import (
    SCHEMA_VERSION,
    TOPIC_MESSAGE,
    DecodeError,
    PromptGroup,
    Scored,
    Segment,
    WeightVersion,
    decode,
    encode,
)

EXAMPLES = VALID


def test_every_topic_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(TOPIC_MESSAGE.values())


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_is_exact(message):
    assert decode(encode(message), type(message)) == message


@pytest.mark.parametrize("data", [b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode([1, 2, 3])])
def test_malformed_bytes_are_rejected_clearly(data):
    with pytest.raises(DecodeError, match="not a valid Scored message"):
        decode(data, Scored)


def test_wrong_type_and_missing_fields_are_named():
    with pytest.raises(DecodeError, match="unknown field"):
        decode(encode(WEIGHTS), Scored)
    partial = msgspec.msgpack.encode({"schema_version": SCHEMA_VERSION, "version": 1})
    with pytest.raises(DecodeError, match="missing required field"):
        decode(partial, WeightVersion)
    wrong_type = msgspec.msgpack.encode({**msgspec.to_builtins(GROUP), "n_samples": "eight"})
    with pytest.raises(DecodeError, match="n_samples"):
        decode(wrong_type, PromptGroup)


def test_unknown_schema_version_is_rejected():
    future = msgspec.structs.replace(WEIGHTS, schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(DecodeError, match="schema_version"):
        decode(encode(future), WeightVersion)


def test_bad_finish_reason_is_rejected():
    raw = msgspec.msgpack.encode({**msgspec.to_builtins(EXAMPLES[1]), "finish_reason": "tired"})
    with pytest.raises(DecodeError, match="finish_reason"):
        decode(raw, Segment)
