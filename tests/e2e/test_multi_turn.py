"""A multi-turn run with the Python tool, as users run it (`asyncrl run`, real broker, calls answered in the
bubblewrap sandbox), read back from its topics: replies are masked out of training, every model token carries a
version and a behaviour logprob, and a turn cut by new weights goes on under them."""

from __future__ import annotations

import json
import math

from transformers import AutoTokenizer

from schemas.messages import Segment, model_token_mask
from tests.e2e.test_pipeline import SMALL_RUN, run_pipeline, trained_view
from topics.readers import read_topic

STEPS, GROUPS, SAMPLES = 10, 4, 4


async def test_a_python_tool_run_trains_on_model_tokens_only_and_turns_cross_weight_updates(
    broker, tmp_path, unique_name, bubblewrap
):
    prefix = unique_name("tool") + "."
    # an untrained chain model writes `]` about one token in twenty: calls (of garbage code) come often
    run_dir = run_pipeline(
        tmp_path, broker.bootstrap, prefix, "data.task=chain", "rollout.workflow=python", "rollout.max_new_tokens=64"
    )
    assert "trainer.steps=10" in SMALL_RUN and "trainer.batch_groups=4" in SMALL_RUN
    manifests, trained, released = await trained_view(broker.bootstrap, prefix)
    assert sorted(m.step for m in manifests) == list(range(1, STEPS + 1)) and len(trained) == STEPS * GROUPS * SAMPLES
    call = AutoTokenizer.from_pretrained(run_dir / "model").convert_tokens_to_ids("]")
    for [(manifest, scored)] in trained.values():
        mask = model_token_mask(scored.loss_mask, len(scored.completion_tokens))
        model = [i for i, m in enumerate(mask) if m]
        assert len(mask) == len(scored.completion_tokens) == len(scored.logprobs) == len(scored.versions)
        assert all(math.isfinite(scored.logprobs[i]) and scored.logprobs[i] <= 0 for i in model)
        low, high = released[scored.prompt_id].released_at_version, manifest.trainer_version
        assert all(low <= scored.versions[i] <= high for i in model)
    with_calls = [s for [(_, s)] in trained.values() if s.tool_calls]
    assert len(with_calls) > len(trained) // 4 and any(0 in s.loss_mask for s in with_calls)  # a reply may be empty

    segments = [r.message for r in await read_topic(broker.bootstrap, prefix + "segments", Segment)]
    turns_with_two_versions = 0
    for [(_, scored)] in trained.values():
        parts = sorted(
            (s for s in segments if s.trajectory_id == scored.trajectory_id and s.attempt == scored.attempt),
            key=lambda s: s.segment_index,
        )
        assert [m for s in parts for m in model_token_mask(s.loss_mask, len(s.token_ids))] == model_token_mask(
            scored.loss_mask, len(scored.completion_tokens)
        )
        versions_of_turn: set[int] = set()
        for part in parts:
            mask = model_token_mask(part.loss_mask, len(part.token_ids))
            if part.finish_reason == "tool":  # the model's turn up to its call, then the reply: masked
                last_model = max(i for i, m in enumerate(mask) if m)
                assert part.token_ids[last_model] == call and not any(mask[last_model + 1 :])
            versions_of_turn.add(part.version)
            if part.finish_reason != "interrupted":  # the turn ends here
                turns_with_two_versions += len(versions_of_turn) > 1
                versions_of_turn = set()
    assert turns_with_two_versions > 0

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == STEPS
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(v) for m in metrics for v in m.values() if isinstance(v, float))
