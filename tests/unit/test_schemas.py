"""Every topic message round-trips exactly; malformed bytes are rejected with a clear error."""

import msgspec
import pytest

from schemas.messages import (
    SCHEMA_VERSION,
    TOPIC_MESSAGE,
    BatchManifest,
    DeadLetter,
    DecodeError,
    DroppedGroup,
    PromptGroup,
    Scored,
    Segment,
    WeightVersion,
    decode,
    encode,
)

GROUP = PromptGroup(
    prompt_id="e0-r17",
    row_index=17,
    epoch=0,
    release_index=3,
    released_at_version=1,
    prompt_text="47+8=",
    prompt_tokens=[5, 8, 10, 9, 11],
    answer="55",
    metadata={"k": "v"},
    n_samples=8,
)
EXAMPLES = [
    GROUP,
    Segment(
        trajectory_id="e0-r17/3",
        attempt="rollout-0:5",
        segment_index=0,
        version=2,
        token_ids=[6, 6],
        logprobs=[-0.25, -1.5],
        finish_reason="interrupted",
        worker_id="rollout-0",
        group=GROUP,
    ),
    Scored(
        trajectory_id="e0-r17/3",
        prompt_id="e0-r17",
        sample_index=3,
        n_samples=8,
        release_index=3,
        released_at_version=1,
        attempt="rollout-0:5",
        prompt_tokens=[5, 8],
        completion_tokens=[6, 6, 1],
        logprobs=[-0.25, -1.5, -0.125],
        versions=[2, 2, 3],
        finish_reason="stop",
        num_segments=2,
        reward=1.0,
        reward_details={"verifier": "exact"},
        completion_text="55",
    ),
    WeightVersion(
        version=3, uri="/tmp/w/v3.safetensors", content_hash="ab", step=3, groups_consumed=24, groups_dropped=1
    ),
    BatchManifest(
        step=4,
        trainer_version=3,
        trajectory_ids=["e0-r17/3"],
        scored_offsets=[(0, 12)],
        consumed_offsets=[(0, 13)],
        dropped=[DroppedGroup(prompt_id="e0-r2", reason="stale")],
    ),
    DeadLetter(origin="reward-0", source="segments", reason="bad", payload=b"\x00\xff", partition=0, offset=4),
]


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
        decode(encode(EXAMPLES[3]), Scored)
    partial = msgspec.msgpack.encode({"schema_version": SCHEMA_VERSION, "version": 1})
    with pytest.raises(DecodeError, match="missing required field"):
        decode(partial, WeightVersion)
    wrong_type = msgspec.msgpack.encode({**msgspec.to_builtins(GROUP), "n_samples": "eight"})
    with pytest.raises(DecodeError, match="n_samples"):
        decode(wrong_type, PromptGroup)


def test_unknown_schema_version_is_rejected():
    future = msgspec.structs.replace(EXAMPLES[3], schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(DecodeError, match="schema_version"):
        decode(encode(future), WeightVersion)


def test_bad_finish_reason_is_rejected():
    raw = msgspec.msgpack.encode({**msgspec.to_builtins(EXAMPLES[1]), "finish_reason": "tired"})
    with pytest.raises(DecodeError, match="finish_reason"):
        decode(raw, Segment)
