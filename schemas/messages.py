"""Every message on every topic, as msgspec Structs encoded as MessagePack.

Each field comment names who writes it and who reads it. A message carries
`schema_version`; a reader (`schemas.validate.decode`) rejects a version it does not know with a clear error
(and the worker sends the bytes to `dead-letter`), read before anything else of the
record, so that a field added by a newer build is reported as the version it is.
The struct's name travels in the `schema` message header so that replay tools can
decode any topic.

Versions: 1, the first; 2 adds `loss_mask` to `Segment` and `Scored`, `tool_calls`
to `Scored` and the finish reason "tool"; 3 adds `groups_skipped` to `WeightVersion`; 4 adds
`base_version` to `WeightVersion` (delta versions: a reader that does not know it must not load one).
This build reads all four (an older record is a version 4 record with the new fields
at their defaults: replay of old exports and topics) and writes 4.
"""

from __future__ import annotations

from typing import Literal

import msgspec

SCHEMA_VERSION = 4
READABLE_VERSIONS: frozenset[int] = frozenset({1, 2, 3, 4})  # what `validate.decode` accepts (module docstring)

# "interrupted": a new policy version cut the segment; "tool": the model's turn ended at a tool call and the
# tool's output follows in the same segment. Both are non-terminal: more segments of the same attempt follow.
FinishReason = Literal["interrupted", "tool", "stop", "length", "error"]
TERMINAL_REASONS: frozenset[str] = frozenset({"stop", "length", "error"})


def trajectory_id(prompt_id: str, sample_index: int) -> str:
    """The id of one sample of a prompt group: "<prompt_id>/<sample_index>" (prompt ids may hold '/')."""
    return f"{prompt_id}/{sample_index}"


def split_trajectory_id(trajectory: str) -> tuple[str, int]:
    """(prompt id, sample index) of a trajectory id; ValueError for an id not made by `trajectory_id`."""
    prompt_id, sep, sample = trajectory.rpartition("/")
    if not sep or not prompt_id or not sample.isdigit():
        raise ValueError(f"{trajectory!r} is not a trajectory id '<prompt_id>/<sample_index>'")
    return prompt_id, int(sample)


def prompt_id_of(trajectory: str) -> str:
    return split_trajectory_id(trajectory)[0]


def model_token_mask(loss_mask: list[int], tokens: int) -> list[int]:
    """A `loss_mask` written out: the empty mask (every token a model token) as one 1 per token."""
    return loss_mask or [1] * tokens


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every topic message."""

    schema_version: int = SCHEMA_VERSION


class PromptGroup(Message, kw_only=True):
    """Topic `prompts`, key = prompt_id. Prompt source -> rollout workers."""

    prompt_id: str  # source: unique per run, dataset row and epoch; rollout: prefix of trajectory ids
    row_index: int  # source: the dataset row; replay: find the row again
    epoch: int  # source: pass over the dataset (0-based)
    release_index: int  # source: increasing over the run's releases; trainer: oldest first
    released_at_version: int  # source: trainer version when released; rollout waits to hold it; trainer: staleness
    prompt_text: str  # source; reward: passed to the reward function
    prompt_tokens: list[int]  # source (tokenised once); rollout: the prefix to generate from
    answer: str  # source: the reference answer; reward: the verifier compares against it
    metadata: dict[str, str] = {}  # source: free-form row fields (tests, ids); reward: passed through
    n_samples: int  # source; rollout: completions to generate; reward, trainer: group is complete at n


class Segment(Message, kw_only=True):
    """Topic `segments`, key = trajectory_id. Rollout workers -> reward workers.

    A run of tokens of one trajectory generated under one policy version. A
    trajectory is the segments 0..k of one attempt, the last one terminal.
    """

    trajectory_id: str  # rollout: "<prompt_id>/<sample_index>"
    attempt: str  # rollout: "<worker_id>:<counter>"; reward keeps the first attempt that finishes
    segment_index: int  # rollout: 0, 1, ... within the attempt
    version: int  # rollout: policy version of every token in this segment
    token_ids: list[int]  # rollout: generated tokens (may be empty for an empty interrupted run)
    logprobs: list[float]  # rollout: behaviour logprob of each token, same length as token_ids
    finish_reason: FinishReason  # rollout: "interrupted" or "tool" = more segments follow
    worker_id: str  # rollout: who generated it
    group: PromptGroup | None = None  # rollout: the prompt, on segment 0 only; reward: builds `scored`
    error: str = ""  # rollout: why, when finish_reason == "error"
    # rollout: per token 1 = a model token, 0 = an environment (tool output) token the model conditions on
    # but is not trained on (its logprob a placeholder, finite and <= 0: 0.0); empty = every token is a model
    # token. A "tool" segment holds the model's turn, then the tool's output. Reward: joined into `Scored`.
    loss_mask: list[int] = []


class Scored(Message, kw_only=True):
    """Topic `scored`, key = prompt_id. Reward workers -> trainer. One finished trajectory."""

    trajectory_id: str  # reward: "<prompt_id>/<sample_index>"; trainer: trained at most once
    prompt_id: str  # reward; trainer: groups trajectories
    sample_index: int  # reward
    n_samples: int  # reward (from the group); trainer: the group is complete at n
    release_index: int  # reward (from the group); trainer: oldest groups first
    released_at_version: int  # reward (from the group); trainer: staleness check
    attempt: str  # reward: which attempt was kept
    prompt_tokens: list[int]  # reward; trainer: the prefix (versions -1)
    completion_tokens: list[int]  # reward: concatenated segment tokens
    logprobs: list[float]  # reward: behaviour logprob per completion token
    versions: list[int]  # reward: policy version per completion token
    finish_reason: FinishReason  # reward: finish reason of the last segment
    num_segments: int  # reward; trainer: with tool_calls, how often the trajectory was interrupted
    reward: float  # reward worker
    reward_details: dict[str, str] = {}  # reward worker: verifier output, failures ("error", "timeout")
    completion_text: str = ""  # reward worker: decoded completion (model and tool text), for humans and replay
    # reward: the segments' masks joined, per completion token 1 = a model token (trained), 0 = an environment
    # (tool output) token (not trained; its logprob and version are placeholders); empty = every token is a
    # model token (single-turn trajectories, version 1 records). Trainer: the per-token loss mask.
    loss_mask: list[int] = []
    tool_calls: int = 0  # reward: segments that ended with "tool"; the other non-terminal ones were interrupted

    @property
    def interruptions(self) -> int:
        """How often a new policy version cut this trajectory: its non-terminal segments less its tool calls."""
        return self.num_segments - 1 - self.tool_calls


class WeightVersion(Message, kw_only=True):
    """Topic `weights` (one partition), no key. Trainer -> rollout workers, prompt source."""

    version: int  # trainer: number of optimizer steps behind these weights (0 = initial)
    uri: str  # trainer: path of the safetensors file on shared storage; rollout loads it
    content_hash: str  # trainer: sha256 of the version's whole file; every reader verifies it before loading
    base_version: int = -1  # trainer: -1, `uri` is the whole version; else `uri` is a delta against this version
    # and `content_hash` the hash of the whole file it makes; rollout: applies the chain (workers.weight_deltas)
    step: int  # trainer: the step that produced the version
    groups_consumed: int  # trainer: groups trained so far
    groups_dropped: int  # trainer: groups dropped so far; source: widens the staleness window
    groups_skipped: int = 0  # trainer: of those, the ones without advantage; source: releases ahead of such skips
    final: bool = False  # trainer: no further versions follow; workers may stop


class DroppedGroup(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt_id: str
    reason: str  # e.g. "stale: released at v3, trainer at v8 > eta=4"


class BatchManifest(Message, kw_only=True):
    """Topic `batches`, key = step. Trainer -> replay, recovery. Written before the step."""

    step: int  # trainer: the optimizer step this batch is for (produces version == step)
    trainer_version: int  # trainer: version of the weights being updated (step - 1)
    trajectory_ids: list[str]  # trainer: exactly the trajectories of this step
    scored_offsets: list[tuple[int, int]]  # trainer: (partition, offset) in `scored` of each trajectory
    consumed_offsets: list[tuple[int, int]]  # trainer: (partition, next offset) read so far
    dropped: list[DroppedGroup] = []  # trainer: groups dropped since the previous manifest
    uniform: list[str] = []  # trainer: prompt ids, of those trained or dropped, whose samples all scored alike
    # (no advantage); readers: which prompts taught nothing


class DeadLetter(Message, kw_only=True):
    """Topic `dead-letter`, key = origin. Any worker -> operators, replay."""

    origin: str  # the worker id that gave up on the payload
    source: str  # where the payload came from: a topic name or a dataset path
    reason: str  # a human-readable error
    payload: bytes = b""  # the original bytes (message value, or a dataset line)
    partition: int = -1  # for a topic source
    offset: int = -1  # for a topic source; a 1-based line number for a dataset


TOPIC_MESSAGE: dict[str, type[Message]] = {
    "prompts": PromptGroup,
    "segments": Segment,
    "scored": Scored,
    "weights": WeightVersion,
    "batches": BatchManifest,
    "dead-letter": DeadLetter,
}

_ENCODER = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _ENCODER.encode(message)
