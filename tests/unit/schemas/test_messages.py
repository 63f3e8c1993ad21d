"""Every topic message round-trips exactly; malformed bytes are rejected with a clear error."""

import msgspec
import pytest

from schemas.messages import (
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    TOPIC_MESSAGE,
    PromptGroup,
    Scored,
    Segment,
    WeightVersion,
    encode,
)
from schemas.validate import DecodeError, decode
from tests.message_examples import FIRST, GROUP, SCORED, SCORED_TOOL, VALID, WEIGHTS

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


def test_a_newer_version_is_named_before_its_new_fields_are_called_unknown():
    """What an older reader meets in a newer record, one version on: the version, not 'unknown field'."""
    assert SCHEMA_VERSION == 4 and sorted(READABLE_VERSIONS) == [1, 2, 3, 4]
    future = msgspec.msgpack.encode({**msgspec.to_builtins(SCORED_TOOL), "schema_version": 5, "turns": [0, 5]})
    with pytest.raises(DecodeError) as refused:
        decode(future, Scored)
    assert str(refused.value) == "Scored has schema_version 5, this build reads 1, 2, 3, 4"
    with pytest.raises(DecodeError, match="unknown field `turns`"):  # a field no version has: still refused
        decode(msgspec.msgpack.encode({**msgspec.to_builtins(SCORED_TOOL), "turns": [0, 5]}), Scored)


@pytest.mark.parametrize("message", [SCORED, FIRST], ids=lambda m: type(m).__name__)
def test_a_version_1_record_decodes_with_the_new_fields_at_their_defaults(message):
    """Old exports and topics replay: version 1 had no loss_mask and no tool_calls."""
    fields = msgspec.to_builtins(message)
    old = {name: value for name, value in fields.items() if name not in ("loss_mask", "tool_calls")}
    decoded = decode(msgspec.msgpack.encode({**old, "schema_version": 1}), type(message))
    assert decoded == msgspec.structs.replace(message, schema_version=1, loss_mask=[])
    assert decoded.loss_mask == [] and getattr(decoded, "tool_calls", 0) == 0


def test_a_version_2_announcement_decodes_with_no_skips_counted():
    old = {name: value for name, value in msgspec.to_builtins(WEIGHTS).items() if name != "groups_skipped"}
    decoded = decode(msgspec.msgpack.encode({**old, "schema_version": 2}), WeightVersion)
    assert decoded == msgspec.structs.replace(WEIGHTS, schema_version=2, groups_skipped=0)


def test_a_version_3_announcement_is_a_whole_version():
    old = {name: value for name, value in msgspec.to_builtins(WEIGHTS).items() if name != "base_version"}
    decoded = decode(msgspec.msgpack.encode({**old, "schema_version": 3}), WeightVersion)
    assert decoded.base_version == -1


def test_interruptions_are_the_non_terminal_segments_that_were_no_tool_call():
    assert (SCORED.num_segments, SCORED.tool_calls, SCORED.interruptions) == (2, 0, 1)
    assert (SCORED_TOOL.num_segments, SCORED_TOOL.tool_calls, SCORED_TOOL.interruptions) == (2, 1, 0)


def test_bad_finish_reason_is_rejected():
    raw = msgspec.msgpack.encode({**msgspec.to_builtins(EXAMPLES[1]), "finish_reason": "tired"})
    with pytest.raises(DecodeError, match="finish_reason"):
        decode(raw, Segment)
