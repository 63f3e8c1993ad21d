"""Bytes off a topic into a message that holds the contracts of the field comments in `messages.py`.

`decode` reads the version first, then the strict struct (msgspec checks types), then the values: finite
numbers, lengths that agree, ids in their documented shape, counts and versions in range. Each `*_problems`
function returns the problems in words (empty for a valid message) and needs nothing but the message;
`decode` refuses a message with any, so a worker never meets one. What needs context (the model's vocabulary,
a group's other trajectories) is checked by the worker that holds it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from schemas.messages import (
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    TERMINAL_REASONS,
    TOPIC_MESSAGE,
    BatchManifest,
    DeadLetter,
    Message,
    PromptGroup,
    Scored,
    Segment,
    WeightVersion,
    split_trajectory_id,
)

# Far above any GRPO group (4 to 256 samples in practice), low enough that no worker sets out to generate,
# buffer or normalise an absurd group because of one record.
MAX_SAMPLES = 65_536
# Above every real vocabulary (a few hundred thousand ids), and an int32 still holds it: a token id past it
# would overflow the integer tensors and the Rust tokenizers before any vocabulary check could refuse it.
MAX_TOKEN_ID = 2**31 - 1
# A logprob is <= 0; float32 log-softmax rounds a near-certain token's to a few ulps above 0, never to 1e-3.
LOGPROB_EPSILON = 1e-3
# The trainer holds rewards in float32 and normalises each group: (r - mean) / std squares differences up
# to 2e6, i.e. 4e12 per sample and under 3e17 for MAX_SAMPLES samples, far below float32's 3.4e38, while
# float32 still resolves 0.125 at 1e6. A reward of 1e20 would square to inf and make every advantage NaN.
MAX_ABS_REWARD = 1e6
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def prompt_group_problems(group: PromptGroup) -> list[str]:
    """A release the rollout can generate from and the trainer can count: a prompt, at least one sample."""
    return [
        *_non_empty("prompt_id", group.prompt_id),
        *_not_negative(group, "row_index", "epoch", "release_index", "released_at_version"),
        *_non_empty("prompt_tokens", group.prompt_tokens),
        *_token_ids("prompt_tokens", group.prompt_tokens),
        *_samples(group.n_samples),
    ]


def segment_problems(segment: Segment) -> list[str]:
    """A run of tokens the reward worker can join into a trajectory: one logprob (and mask entry) per token,
    the group on segment 0 only and for this trajectory's prompt.

    Where the mask's zeros lie is not checked: a tool may return nothing (a "tool" segment without a 0), and
    a refused segment leaves its trajectory, and so its whole group, for ever incomplete."""
    problems = [
        *_trajectory_id("trajectory_id", segment.trajectory_id),
        *_non_empty("attempt", segment.attempt),
        *_non_empty("worker_id", segment.worker_id),
        *_not_negative(segment, "segment_index", "version"),
        *_token_ids("token_ids", segment.token_ids),
        *_same_length("logprobs", segment.logprobs, "token_ids", segment.token_ids),
        *_logprobs("logprobs", segment.logprobs),
        *_loss_mask(segment.loss_mask, "token_ids", segment.token_ids),
    ]
    if segment.group is not None:
        problems += _segment_group(segment, segment.group)
    return problems


def scored_problems(scored: Scored) -> list[str]:
    """A trajectory the trainer can train: ids that agree, one logprob, one version (and one mask entry) per
    completion token, a terminal finish, a finite reward that stays finite through group normalisation.

    A completion of tool tokens only is valid: it trains nothing (the loss and its token and sequence totals
    count model tokens only), while refusing it would leave its group incomplete and stall the trainer at
    the group's staleness deadline."""
    problems = [
        *_trajectory_of(scored.trajectory_id, scored.prompt_id, scored.sample_index),
        *_samples(scored.n_samples),
        *_sample_index(scored.sample_index, scored.n_samples),
        *_not_negative(scored, "release_index", "released_at_version"),
        *_non_empty("attempt", scored.attempt),
        *_non_empty("prompt_tokens", scored.prompt_tokens),
        *_token_ids("prompt_tokens", scored.prompt_tokens),
        *_token_ids("completion_tokens", scored.completion_tokens),
        *_same_length("logprobs", scored.logprobs, "completion_tokens", scored.completion_tokens),
        *_same_length("versions", scored.versions, "completion_tokens", scored.completion_tokens),
        *_logprobs("logprobs", scored.logprobs),
        *_versions_since(scored.versions, scored.released_at_version),
        *_at_least("num_segments", scored.num_segments, 1),
        *_tool_calls(scored.tool_calls, scored.num_segments),
        *_reward(scored.reward),
        *_loss_mask(scored.loss_mask, "completion_tokens", scored.completion_tokens),
    ]
    if scored.finish_reason not in TERMINAL_REASONS:
        problems.append(f"finish_reason {scored.finish_reason!r} is not terminal: a scored trajectory has ended")
    elif not scored.completion_tokens and scored.finish_reason != "error":
        problems.append(f"completion_tokens is empty, yet the trajectory ended with {scored.finish_reason!r}")
    return problems


def weight_version_problems(announced: WeightVersion) -> list[str]:
    """An announcement every reader can verify: counts >= 0 and a sha256 to check the file against."""
    problems = _not_negative(announced, "version", "step", "groups_consumed", "groups_dropped", "groups_skipped")
    if not SHA256_HEX.fullmatch(announced.content_hash):
        problems.append(f"content_hash {_cut(announced.content_hash)!r} is not 64 lowercase hex digits (sha256)")
    return problems


def batch_manifest_problems(manifest: BatchManifest) -> list[str]:
    """A manifest a restarted trainer can redo: one `scored` position per trajectory id, offsets >= 0."""
    problems = [
        *_at_least("step", manifest.step, 1),
        *_not_negative(manifest, "trainer_version"),
        *_same_length("scored_offsets", manifest.scored_offsets, "trajectory_ids", manifest.trajectory_ids),
        *_positions("scored_offsets", manifest.scored_offsets),
        *_positions("consumed_offsets", manifest.consumed_offsets),
    ]
    bad = next((t for t in manifest.trajectory_ids if _bad_id(t)), None)
    if bad is not None:
        problems += _trajectory_id("trajectory_ids", bad)
    if len(set(manifest.trajectory_ids)) != len(manifest.trajectory_ids):
        problems.append("trajectory_ids names a trajectory twice")
    if any(not d.prompt_id or not d.reason for d in manifest.dropped):
        problems.append("a dropped group has no prompt_id or no reason")
    return problems


def dead_letter_problems(letter: DeadLetter) -> list[str]:
    """None: a dead letter records what failed, whatever it holds."""
    return []


PROBLEMS: dict[type[Message], Callable[[Any], list[str]]] = {
    PromptGroup: prompt_group_problems,
    Segment: segment_problems,
    Scored: scored_problems,
    WeightVersion: weight_version_problems,
    BatchManifest: batch_manifest_problems,
    DeadLetter: dead_letter_problems,
}


def problems(message: Message) -> list[str]:
    """What is wrong with `message` (empty when nothing is), by its kind."""
    return PROBLEMS[type(message)](message)


class DecodeError(ValueError):
    """Bytes that are not a valid message of the expected type."""


class _Versioned(msgspec.Struct):
    """Any record's version alone, whatever else it holds (unknown fields ignored): read first by `decode`."""

    schema_version: int = SCHEMA_VERSION


_DECODERS = {cls: msgspec.msgpack.Decoder(cls) for cls in TOPIC_MESSAGE.values()}
_VERSION_DECODER = msgspec.msgpack.Decoder(_Versioned)

M = TypeVar("M", bound=Message)


def decode(data: bytes, cls: type[M]) -> M:
    """Decode `data` as `cls`, or raise DecodeError saying what is wrong (the type, the version or the values).

    Nothing else escapes: bytes off a topic are anyone's, and a worker dead-letters a DecodeError.
    """
    version = _read(data, cls, _VERSION_DECODER).schema_version
    if version not in READABLE_VERSIONS:  # before the strict decoding, which would call a new field unknown
        readable = ", ".join(map(str, sorted(READABLE_VERSIONS)))
        raise DecodeError(f"{cls.__name__} has schema_version {version}, this build reads {readable}")
    message = _read(data, cls, _DECODERS[cls])
    if found := problems(message):
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise DecodeError(f"not a valid {cls.__name__} message: {'; '.join(found[:3])}{more}")
    return message


def _read(data: bytes, cls: type[Message], decoder: msgspec.msgpack.Decoder) -> Any:
    """`decoder`'s struct of `data`, or DecodeError naming `cls`."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"not a valid {cls.__name__} message: {exc}") from exc
    except Exception as exc:  # invalid UTF-8 in a string (UnicodeDecodeError), deep nesting, ...
        raise DecodeError(f"not a valid {cls.__name__} message: {type(exc).__name__}: {exc}") from exc


def _segment_group(segment: Segment, group: PromptGroup) -> list[str]:
    problems = [f"group: {problem}" for problem in prompt_group_problems(group)]
    if segment.segment_index != 0:
        problems.append(f"segment {segment.segment_index} carries the group, which travels on segment 0 only")
    if not _bad_id(segment.trajectory_id):
        prompt_id, sample = split_trajectory_id(segment.trajectory_id)
        if prompt_id != group.prompt_id:
            problems.append(f"group.prompt_id {_cut(group.prompt_id)!r} is not the trajectory's {_cut(prompt_id)!r}")
        problems += _sample_index(sample, group.n_samples)
    if segment.version < group.released_at_version:
        problems.append(f"version {segment.version} precedes the group's release at v{group.released_at_version}")
    return problems


def _trajectory_of(trajectory: str, prompt_id: str, sample_index: int) -> list[str]:
    if _bad_id(trajectory):
        return _trajectory_id("trajectory_id", trajectory)
    own_prompt, own_sample = split_trajectory_id(trajectory)
    problems = [] if own_prompt == prompt_id else [f"prompt_id {_cut(prompt_id)!r} is not the trajectory's"]
    if own_sample != sample_index:
        problems.append(f"sample_index {sample_index} is not the trajectory's {own_sample}")
    return problems


def _trajectory_id(name: str, trajectory: str) -> list[str]:
    return [f"{name}: {_cut(trajectory)!r} is not '<prompt_id>/<sample_index>'"] if _bad_id(trajectory) else []


def _bad_id(trajectory: str) -> bool:
    try:
        split_trajectory_id(trajectory)
    except ValueError:
        return True
    return False


def _samples(n_samples: int) -> list[str]:
    if 1 <= n_samples <= MAX_SAMPLES:
        return []
    return [f"n_samples is {n_samples}, must lie in [1, {MAX_SAMPLES}]"]


def _sample_index(sample_index: int, n_samples: int) -> list[str]:
    if 0 <= sample_index < n_samples:
        return []
    return [f"sample_index {sample_index} is outside the group's {n_samples} samples"]


def _not_negative(message: Any, *names: str) -> list[str]:
    return [problem for name in names for problem in _at_least(name, getattr(message, name), 0)]


def _at_least(name: str, value: int, low: int) -> list[str]:
    return [] if value >= low else [f"{name} is {value}, must be >= {low}"]


def _non_empty(name: str, value: Sequence) -> list[str]:
    return [] if value else [f"{name} is empty"]


def _same_length(name: str, values: Sequence, other: str, others: Sequence) -> list[str]:
    if len(values) == len(others):
        return []
    return [f"{len(values)} {name} for {len(others)} {other}"]


def _token_ids(name: str, ids: list[int]) -> list[str]:
    if not ids or (min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID):
        return []
    return [f"{name} must lie in [0, {MAX_TOKEN_ID}], got {min(ids)}..{max(ids)}"]


def _logprobs(name: str, values: list[float]) -> list[str]:
    if all(map(math.isfinite, values)) and (not values or max(values) <= LOGPROB_EPSILON):
        return []  # the common case at C speed: trajectories run to thousands of tokens
    bad = next(i for i, v in enumerate(values) if not (math.isfinite(v) and v <= LOGPROB_EPSILON))
    return [f"{name}[{bad}] is {values[bad]}: a logprob is finite and <= 0"]


def _versions_since(versions: list[int], released_at_version: int) -> list[str]:
    if not versions or min(versions) >= released_at_version:
        return []
    return [f"a token has version {min(versions)}, before the group's release at v{released_at_version}"]


def _loss_mask(mask: list[int], name: str, tokens: Sequence) -> list[str]:
    """Empty (every token a model token), or one 0 or 1 per token."""
    if not mask:
        return []
    problems = _same_length("loss_mask", mask, name, tokens)
    if not set(mask) <= {0, 1}:
        bad = next(i for i, m in enumerate(mask) if m not in (0, 1))
        problems.append(f"loss_mask[{bad}] is {mask[bad]}: 1 marks a model token, 0 a tool token")
    return problems


def _tool_calls(tool_calls: int, num_segments: int) -> list[str]:
    if 0 <= tool_calls < max(num_segments, 1):
        return []
    return [f"tool_calls is {tool_calls}, must lie in [0, num_segments - 1]: the last segment is terminal"]


def _reward(reward: float) -> list[str]:
    if math.isfinite(reward) and abs(reward) <= MAX_ABS_REWARD:
        return []
    return [f"reward is {reward}, must be finite and within ±{MAX_ABS_REWARD:g}"]


def _positions(name: str, positions: list[tuple[int, int]]) -> list[str]:
    if all(partition >= 0 and offset >= 0 for partition, offset in positions):
        return []
    return [f"{name} holds a negative partition or offset"]


def _cut(text: str, limit: int = 80) -> str:
    """Long ids cut in messages: a reason must stay one readable line."""
    return text if len(text) <= limit else text[:limit] + "…"
