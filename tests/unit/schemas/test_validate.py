"""The value contracts of every message (`schemas/validate.py`), rule by rule, and `decode` under any bytes.

Exact cases change one field of a valid message and name the one problem it must produce; property tests
throw random bytes, mutated encodings and random field values at `decode`, which may only return a message
that passes its validator or raise DecodeError.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import validate
from schemas.messages import TOPIC_MESSAGE, DeadLetter, DroppedGroup, Message, PromptGroup, Scored, Segment, encode
from schemas.validate import MAX_ABS_REWARD, MAX_SAMPLES, MAX_TOKEN_ID, DecodeError, decode, problems
from tests.message_examples import FIRST, GROUP, LATER, MANIFEST, SCORED, TOOL, VALID, WEIGHTS


def problems_after(message: Message, **changes: Any) -> list[str]:
    return problems(msgspec.structs.replace(message, **changes))


def check(message: Message, changes: dict[str, Any], expected: list[str]) -> None:
    """Exactly the expected problems, in order, each named by a part of its text."""
    found = problems_after(message, **changes)
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found, strict=True)), found


def test_the_valid_examples_have_no_problem_and_cover_every_topic():
    assert [problems(m) for m in VALID] == [[]] * len(VALID)
    assert {type(m) for m in VALID} == set(TOPIC_MESSAGE.values())


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"prompt_id": ""}, ["prompt_id is empty"]),
        ({"row_index": -1}, ["row_index is -1"]),
        ({"epoch": -1}, ["epoch is -1"]),
        ({"release_index": -1}, ["release_index is -1"]),
        ({"released_at_version": -2}, ["released_at_version is -2"]),
        ({"prompt_tokens": []}, ["prompt_tokens is empty"]),
        ({"prompt_tokens": [5, -1]}, ["prompt_tokens must lie in [0, 2147483647], got -1..5"]),
        ({"prompt_tokens": [MAX_TOKEN_ID + 1]}, ["prompt_tokens must lie in"]),
        ({"n_samples": 0}, ["n_samples is 0"]),
        ({"n_samples": MAX_SAMPLES + 1}, [f"n_samples is {MAX_SAMPLES + 1}"]),
    ],
    ids=str,
)
def test_prompt_group_rules(changes, expected):
    check(GROUP, changes, expected)


@pytest.mark.parametrize(
    ("base", "changes", "expected"),
    [
        (LATER, {"trajectory_id": "e0-r17"}, ["trajectory_id: 'e0-r17' is not '<prompt_id>/<sample_index>'"]),
        (LATER, {"trajectory_id": "e0-r17/x"}, ["is not '<prompt_id>/<sample_index>'"]),
        (LATER, {"attempt": ""}, ["attempt is empty"]),
        (LATER, {"worker_id": ""}, ["worker_id is empty"]),
        (LATER, {"segment_index": -1}, ["segment_index is -1"]),
        (LATER, {"version": -1}, ["version is -1"]),
        (LATER, {"token_ids": [6, -3]}, ["token_ids must lie in"]),
        (LATER, {"logprobs": [-0.25]}, ["1 logprobs for 2 token_ids"]),
        (LATER, {"logprobs": [-0.25, math.nan]}, ["logprobs[1] is nan"]),
        (LATER, {"logprobs": [math.inf, -1.0]}, ["logprobs[0] is inf"]),
        (LATER, {"logprobs": [-1.0, -math.inf]}, ["logprobs[1] is -inf"]),
        (LATER, {"logprobs": [0.5, -1.0]}, ["logprobs[0] is 0.5"]),
        (LATER, {"group": GROUP}, ["segment 1 carries the group"]),
        (FIRST, {"group": msgspec.structs.replace(GROUP, n_samples=0)}, ["group: n_samples is 0", "outside"]),
        (FIRST, {"group": msgspec.structs.replace(GROUP, prompt_id="e0-r9")}, ["group.prompt_id 'e0-r9'"]),
        (FIRST, {"trajectory_id": "e0-r17/8"}, ["sample_index 8 is outside the group's 8 samples"]),
        (FIRST, {"version": 0}, ["version 0 precedes the group's release at v1"]),
        (TOOL, {"loss_mask": [1, 0, 0]}, ["3 loss_mask for 4 token_ids"]),
        (TOOL, {"loss_mask": [1, 0, 2, 0]}, ["loss_mask[2] is 2: 1 marks a model token, 0 a tool token"]),
        (TOOL, {"loss_mask": [-1, 1, 0, 0]}, ["loss_mask[0] is -1"]),
    ],
    ids=lambda value: {id(FIRST): "segment0", id(LATER): "segment1", id(TOOL): "tool"}.get(id(value), str(value)),
)
def test_segment_rules(base, changes, expected):
    check(base, changes, expected)


@pytest.mark.parametrize(
    "changes",
    [
        {},  # the model's turn, then the tool's output
        {"loss_mask": []},  # a tool that returned nothing: every token is the model's
        {"loss_mask": [1, 1, 1, 1]},  # the same, spelled out
        {"loss_mask": [0, 0, 0, 0]},  # only tool output: an interrupted turn's call was cut before the tool ran
        {"loss_mask": [1, 0, 1, 0]},  # zeros anywhere: where the tool output lies is the rollout's to say
        {"finish_reason": "stop"},  # tool output before the end: a final turn after the tool, in one segment
    ],
    ids=str,
)
def test_tool_segments_that_are_valid(changes):
    assert problems_after(TOOL, **changes) == []


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"trajectory_id": "/3"}, ["trajectory_id: '/3' is not"]),
        ({"prompt_id": "e0-r9"}, ["prompt_id 'e0-r9' is not the trajectory's"]),
        ({"sample_index": 4}, ["sample_index 4 is not the trajectory's 3"]),
        ({"n_samples": 0}, ["n_samples is 0", "sample_index 3 is outside the group's 0 samples"]),
        ({"n_samples": 3}, ["sample_index 3 is outside the group's 3 samples"]),
        ({"release_index": -1}, ["release_index is -1"]),
        ({"released_at_version": -1}, ["released_at_version is -1"]),
        ({"attempt": ""}, ["attempt is empty"]),
        ({"prompt_tokens": []}, ["prompt_tokens is empty"]),
        ({"prompt_tokens": [-1]}, ["prompt_tokens must lie in"]),
        ({"completion_tokens": [6, 6, MAX_TOKEN_ID + 1]}, ["completion_tokens must lie in"]),
        ({"logprobs": [-0.25]}, ["1 logprobs for 3 completion_tokens"]),  # one logprob for three tokens
        ({"versions": [2, 2]}, ["2 versions for 3 completion_tokens"]),
        ({"logprobs": [-0.25, -1.5, math.nan]}, ["logprobs[2] is nan"]),
        ({"versions": [0, 2, 3]}, ["a token has version 0, before the group's release at v1"]),
        ({"versions": [-1, 2, 3], "released_at_version": 0}, ["a token has version -1"]),
        ({"num_segments": 0}, ["num_segments is 0"]),
        ({"reward": math.nan}, ["reward is nan"]),
        ({"reward": -math.inf}, ["reward is -inf"]),
        ({"reward": MAX_ABS_REWARD * 10}, ["reward is 10000000.0, must be finite and within ±1e+06"]),
        ({"finish_reason": "interrupted"}, ["finish_reason 'interrupted' is not terminal"]),
        ({"completion_tokens": [], "logprobs": [], "versions": []}, ["completion_tokens is empty, yet"]),
        ({"finish_reason": "tool"}, ["finish_reason 'tool' is not terminal"]),
        ({"loss_mask": [1, 0]}, ["2 loss_mask for 3 completion_tokens"]),
        ({"loss_mask": [1, 1, 3]}, ["loss_mask[2] is 3: 1 marks a model token, 0 a tool token"]),
        ({"tool_calls": -1}, ["tool_calls is -1, must lie in [0, num_segments - 1]"]),
        ({"tool_calls": 2}, ["tool_calls is 2, must lie in [0, num_segments - 1]: the last segment is terminal"]),
        ({"num_segments": 0, "tool_calls": 0}, ["num_segments is 0"]),  # said once, not again by tool_calls
    ],
    ids=str,
)
def test_scored_rules(changes, expected):
    check(SCORED, changes, expected)


@pytest.mark.parametrize(
    "changes",
    [
        {"logprobs": [-0.25, -1.5, 1e-4]},  # float32 rounding of a near-certain token
        {"reward": -MAX_ABS_REWARD},
        {"completion_tokens": [], "logprobs": [], "versions": [], "finish_reason": "error"},  # refused prompt
        {"loss_mask": [1, 1, 1]},  # spelled out, as the empty mask means
        {"loss_mask": [0, 0, 0]},  # tool output only: trains nothing, but refusing it would stall its group
        {"tool_calls": 1},  # segment 0 ended at a tool call that returned nothing
    ],
    ids=str,
)
def test_scored_edge_values_that_are_valid(changes):
    assert problems_after(SCORED, **changes) == []


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"version": -1}, ["version is -1"]),
        ({"step": -1}, ["step is -1"]),
        ({"groups_consumed": -1}, ["groups_consumed is -1"]),
        ({"groups_dropped": -1}, ["groups_dropped is -1"]),
        ({"groups_skipped": -1}, ["groups_skipped is -1"]),
        ({"content_hash": "ab"}, ["content_hash 'ab' is not 64 lowercase hex digits"]),
        ({"content_hash": "0F" * 32}, ["is not 64 lowercase hex digits"]),
        ({"content_hash": "0g" * 32}, ["is not 64 lowercase hex digits"]),
    ],
    ids=str,
)
def test_weight_version_rules(changes, expected):
    check(WEIGHTS, changes, expected)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"step": 0}, ["step is 0, must be >= 1"]),
        ({"trainer_version": -1}, ["trainer_version is -1"]),
        ({"scored_offsets": [(0, 12)]}, ["1 scored_offsets for 2 trajectory_ids"]),
        ({"scored_offsets": [(0, 12), (-1, 3)]}, ["scored_offsets holds a negative partition or offset"]),
        ({"consumed_offsets": [(0, -13)]}, ["consumed_offsets holds a negative"]),
        ({"trajectory_ids": ["e0-r17/3", "e0-r17"]}, ["trajectory_ids: 'e0-r17' is not"]),
        ({"trajectory_ids": ["e0-r17/3", "e0-r17/3"]}, ["names a trajectory twice"]),
        ({"dropped": [DroppedGroup(prompt_id="e0-r2", reason="")]}, ["a dropped group has no prompt_id or no reason"]),
    ],
    ids=str,
)
def test_batch_manifest_rules(changes, expected):
    check(MANIFEST, changes, expected)


def test_a_dead_letter_is_accepted_whatever_it_holds():
    letter = DeadLetter(origin="", source="", reason="", payload=b"\xff" * 3, partition=-7, offset=-9)
    assert decode(encode(letter), DeadLetter) == letter


def test_decode_refuses_an_invalid_message_with_its_first_problems_in_words():
    poisoned = msgspec.structs.replace(SCORED, logprobs=[math.nan] * 3, n_samples=0, num_segments=0, reward=math.inf)
    with pytest.raises(DecodeError) as refused:
        decode(encode(poisoned), Scored)
    assert str(refused.value) == (
        "not a valid Scored message: n_samples is 0, must lie in [1, 65536]; "
        "sample_index 3 is outside the group's 0 samples; logprobs[0] is nan: a logprob is finite and <= 0 (and 2 more)"
    )


def test_decode_turns_invalid_utf8_into_a_decode_error():
    data = bytearray(encode(SCORED))
    data[data.index(b"rollout-0:5")] = 0xFF  # a string that is not UTF-8: UnicodeDecodeError inside msgspec
    with pytest.raises(DecodeError, match="not a valid Scored message: UnicodeDecodeError"):
        decode(bytes(data), Scored)


def test_decode_turns_any_exception_of_the_decoder_into_a_decode_error(monkeypatch):
    class Exhausted:
        def decode(self, data: bytes) -> None:
            raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setitem(validate._DECODERS, Scored, Exhausted())
    with pytest.raises(DecodeError, match="RecursionError: maximum recursion depth exceeded"):
        decode(encode(SCORED), Scored)


def test_decode_refuses_deep_nesting():
    nested = b"\x91" * 100_000 + b"\x00"  # an array in an array ... 100,000 deep
    raw = msgspec.msgpack.encode({**msgspec.to_builtins(GROUP), "metadata": {"k": "v"}})
    with pytest.raises(DecodeError):
        decode(raw.replace(b"\xa1v", nested), PromptGroup)


# ---- properties: whatever the bytes, decode returns a valid message or raises DecodeError ----

PROPERTY = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
KINDS = [type(m) for m in VALID]


def decodes_cleanly(data: bytes, cls: type[Message]) -> None:
    """The property itself: DecodeError, or a message without problems that round-trips and that holds
    what the workers assume (checked here independently of the validator)."""
    try:
        message = decode(data, cls)
    except DecodeError:
        return
    assert problems(message) == []
    assert decode(encode(message), cls) == message
    assert_usable(message)


def assert_usable(message: Message) -> None:
    """Finite floats everywhere, token ids a tensor holds, one logprob (and version) per token, whole groups."""
    fields = msgspec.to_builtins(message)
    assert all(math.isfinite(v) for v in leaves(fields) if isinstance(v, float))
    for name in ("prompt_tokens", "token_ids", "completion_tokens"):
        assert all(0 <= t <= MAX_TOKEN_ID for t in fields.get(name, []))
    tokens = fields.get("token_ids", fields.get("completion_tokens"))
    for name in ("logprobs", "versions"):
        assert name not in fields or len(fields[name]) == len(tokens)
    mask = fields.get("loss_mask", [])
    assert set(mask) <= {0, 1} and (not mask or len(mask) == len(tokens))
    if "n_samples" in fields:
        assert fields["n_samples"] >= 1 and fields["prompt_tokens"]
    if isinstance(message, Scored):
        assert message.trajectory_id == f"{message.prompt_id}/{message.sample_index}"
        assert message.sample_index < message.n_samples
    if isinstance(message, Segment) and message.group is not None:
        assert_usable(message.group)


def leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in leaves(item)]
    if isinstance(value, list):
        return [leaf for item in value for leaf in leaves(item)]
    return [value]


@pytest.mark.parametrize("cls", list(TOPIC_MESSAGE.values()), ids=lambda c: c.__name__)
@PROPERTY
@given(data=st.binary(max_size=256))
def test_random_bytes_only_ever_raise_decode_error(cls, data):
    decodes_cleanly(data, cls)


@pytest.mark.parametrize("example", VALID, ids=lambda m: type(m).__name__)
@PROPERTY
@given(edits=st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0), st.integers(0, 255))))
def test_mutated_encodings_only_ever_raise_decode_error(example, edits):
    data = bytearray(encode(example))
    for edit, where, byte in edits:
        at = where % (len(data) + 1)
        if edit == "insert":
            data.insert(at, byte)
        elif data and edit == "flip":
            data[at % len(data)] ^= byte or 0x80
        elif data:
            del data[at % len(data)]
    decodes_cleanly(bytes(data), type(example))


LEAVES = st.one_of(
    st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8), st.binary(max_size=8), st.booleans(), st.none()
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
IDS = st.sampled_from(["", "e0-r17", "e0-r17/3", "e0-r17/9", "e0-r9/3", "/3", "e0-r17/x", "a/b/0"])


def like(value: Any) -> st.SearchStrategy:
    """Mostly values of `value`'s own type, edge cases first (the validator's ground), now and then anything."""
    if isinstance(value, bool):
        same = st.booleans()
    elif isinstance(value, int):
        same = st.integers(-3, 10) | st.sampled_from([MAX_TOKEN_ID, MAX_TOKEN_ID + 1, MAX_SAMPLES + 1, 2**64 - 1])
    elif isinstance(value, float):
        same = st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, 0.5, MAX_ABS_REWARD * 2])
    elif isinstance(value, str):
        same = IDS | st.text(max_size=8)
    elif isinstance(value, list):
        same = st.lists(like(value[0]) if value else LEAVES, max_size=4)
    else:
        return VALUES
    return st.one_of(same, same, same, VALUES)


def mutate(data: st.DataObject, value: Any) -> Any:
    """`value` with one part replaced: an item of a list or dict (recursively), or the whole of it."""
    if isinstance(value, dict | list) and value and data.draw(st.booleans()):
        where = data.draw(st.sampled_from(sorted(value) if isinstance(value, dict) else range(len(value))))
        changed = dict(value) if isinstance(value, dict) else list(value)
        changed[where] = mutate(data, value[where])
        return changed
    return data.draw(like(value))


@pytest.mark.parametrize("example", VALID, ids=lambda m: type(m).__name__)
@PROPERTY
@given(data=st.data())
def test_messages_with_random_field_values_only_ever_raise_decode_error(example, data):
    fields = msgspec.to_builtins(example)
    for name in data.draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3)):
        fields[name] = mutate(data, fields[name])
    decodes_cleanly(msgspec.msgpack.encode(fields), type(example))
