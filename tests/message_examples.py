"""Valid example messages of every topic, shared by the schema tests (round trips, value contracts)."""

from __future__ import annotations

import msgspec

from schemas.messages import (
    BatchManifest,
    DeadLetter,
    DroppedGroup,
    Message,
    PromptGroup,
    Scored,
    Segment,
    WeightVersion,
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
FIRST = Segment(  # segment 0 carries the group
    trajectory_id="e0-r17/3",
    attempt="rollout-0:5",
    segment_index=0,
    version=2,
    token_ids=[6, 6],
    logprobs=[-0.25, -1.5],
    finish_reason="interrupted",
    worker_id="rollout-0",
    group=GROUP,
)
LATER = msgspec.structs.replace(FIRST, segment_index=1, version=3, finish_reason="stop", group=None)
SCORED = Scored(
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
)
TOOL = msgspec.structs.replace(  # the model's turn (a tool call, 6 7), then the tool's output (8 9): not trained
    FIRST, token_ids=[6, 7, 8, 9], logprobs=[-0.25, -1.5, 0.0, 0.0], finish_reason="tool", loss_mask=[1, 1, 0, 0]
)
SCORED_TOOL = msgspec.structs.replace(  # TOOL, then the answer after the tool's output at v3
    SCORED,
    completion_tokens=[6, 7, 8, 9, 6, 1],
    logprobs=[-0.25, -1.5, 0.0, 0.0, -0.5, -0.125],
    versions=[2, 2, 2, 2, 3, 3],
    loss_mask=[1, 1, 0, 0, 1, 1],
    tool_calls=1,
)
WEIGHTS = WeightVersion(
    version=3,
    uri="/w/v3.safetensors",
    content_hash="0f" * 32,
    step=3,
    groups_consumed=24,
    groups_dropped=1,
    groups_skipped=1,
)
MANIFEST = BatchManifest(
    step=4,
    trainer_version=3,
    trajectory_ids=["e0-r17/3", "e0-r17/4"],
    scored_offsets=[(0, 12), (1, 3)],
    consumed_offsets=[(0, 13), (1, 4)],
    dropped=[DroppedGroup(prompt_id="e0-r2", reason="stale")],
)
LETTER = DeadLetter(origin="reward-0", source="segments", reason="bad", payload=b"\x00\xff", partition=0, offset=4)
VALID: list[Message] = [GROUP, FIRST, LATER, TOOL, SCORED, SCORED_TOOL, WEIGHTS, MANIFEST, LETTER]
