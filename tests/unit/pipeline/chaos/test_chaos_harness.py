"""The parts of `asyncrl chaos` that decide a verdict, without a run: the poison it sends is poison, the audit
finds what is lost or trained twice, the table says FAIL when it must (the leftover scan: tests/integration)."""

from __future__ import annotations

import random
from pathlib import Path

from pipeline.chaos.audit import Audit, fate_of_groups, order_problems, step_problems
from pipeline.chaos.kills import Kill, RunResult
from pipeline.chaos.poison import RACING, READERS, RunView, decodes, randomised, table
from pipeline.chaos.poisoning import reason_kind
from pipeline.chaos.report import role_row
from pipeline.chaos.rows import task_rows, write_dataset
from pipeline.config import load_config, resolve
from pipeline.demo_model import build_model, build_tokenizer
from schemas.messages import TOPIC_MESSAGE, BatchManifest, DroppedGroup, PromptGroup, WeightVersion
from workers.prompt_source import fit_rows
from workers.rows import read_rows

GROUP = PromptGroup(
    prompt_id="e0-r5", row_index=5, epoch=0, release_index=7, released_at_version=1, prompt_text="12+3=",
    prompt_tokens=[4, 5, 13, 6, 14], answer="15", n_samples=4,
)  # fmt: skip
VIEW = RunView(GROUP, 15, "/runs/x/weights/v000001.safetensors", "a" * 64, "/runs/x/corrupt.safetensors")
# Kinds that decode: only a worker holding the model, the group or the run's key can refuse them.
NEEDS_CONTEXT = {
    "scored: token id beyond the vocabulary",
    "scored: n_samples differs from its siblings, racing the real records",
    "segments: token id beyond the vocabulary",
    "segments: token id beyond the vocabulary, racing the real records",
    "prompts: token id beyond the vocabulary",
    "weights: missing file",
    "weights: corrupt file",
    "weights: forged final",
    "weights: forged final, wrong signature",
}


def test_the_table_holds_every_kind_and_each_is_refused_at_decode_unless_it_needs_context() -> None:
    poisons = table(VIEW, random.Random(0))
    kinds = {p.kind for p in poisons}
    assert len(kinds) == len(poisons) and kinds >= NEEDS_CONTEXT
    for wanted in ("NaN logprob", "inf logprob", "NaN reward", "malformed trajectory id", "huge token id",
                   "n_samples = 0", "invalid UTF-8", "random bytes", "one logprob for three tokens",
                   "empty token lists", "negative version"):  # fmt: skip
        assert any(wanted in kind for kind in kinds), wanted
    for poison in poisons:
        assert poison.readers == (() if poison.kind.endswith(RACING) else READERS[poison.role]), poison.kind
        assert decodes(poison.value or b"", TOPIC_MESSAGE[poison.role]) == (poison.kind in NEEDS_CONTEXT), poison.kind


def test_randomised_records_are_all_poison_and_repeat_with_the_seed() -> None:
    first, still_valid = randomised(VIEW, random.Random(3), 2000)
    again, _ = randomised(VIEW, random.Random(3), 2000)
    assert len(first) == 2000 and [p.value for p in first] == [p.value for p in again]
    assert not any(decodes(p.value, TOPIC_MESSAGE[p.role]) for p in first)
    assert {p.role for p in first} == set(READERS) and still_valid > 0  # valid mutations happen, and are not sent


def test_every_bad_dataset_row_is_refused_and_the_good_ones_keep_their_order(tmp_path: Path) -> None:
    model = tmp_path / "model"
    build_model(model, build_tokenizer(model), seed=0)
    train, _ = task_rows(0, 200)
    bad_lines = write_dataset(tmp_path / "rows.jsonl", train[:50], 200, random.Random(1))
    config = resolve(load_config(None, [f"model.path={model}", f"runs_dir={tmp_path}"]))
    rows, bad = read_rows(tmp_path / "rows.jsonl")
    rows, unfit = fit_rows(config, build_tokenizer(model), rows)
    assert sorted(row.line for row in bad + unfit) == sorted(bad_lines)
    assert [row.prompt for row in rows] == [row["prompt"] for row in train[:50]]


def released(n: int) -> PromptGroup:
    return PromptGroup(
        prompt_id=f"p{n}", row_index=n, epoch=0, release_index=n, released_at_version=0, prompt_text="1+2=",
        prompt_tokens=[4], answer="3", n_samples=2,
    )  # fmt: skip


def manifest(step: int, *trajectories: str, dropped: tuple[str, ...] = ()) -> BatchManifest:
    return BatchManifest(
        step=step, trainer_version=step - 1, trajectory_ids=list(trajectories),
        scored_offsets=[(0, i) for i in range(len(trajectories))], consumed_offsets=[],
        dropped=[DroppedGroup(prompt_id=p, reason="stale") for p in dropped],
    )  # fmt: skip


def test_the_audit_finds_lost_groups_and_gaps_in_steps_and_versions() -> None:
    manifests = [manifest(1, "p0/0", "p0/1"), manifest(2, "p1/0", dropped=("p2",)), manifest(2, "p9/0", "p9/1")]
    result = Audit()
    fate_of_groups(result, [released(n) for n in range(4)], manifests, {t for m in manifests for t in m.trajectory_ids})
    assert result.lost == ["p1", "p3"] and result.trained_groups == 1 and result.dropped_groups == 1
    assert result.problems == ["group 'p9' trained but never released"]
    versions = [WeightVersion(version=v, uri="", content_hash="", step=v, groups_consumed=0, groups_dropped=0)
                for v in (0, 1)]  # fmt: skip
    found = step_problems(manifests, versions, 3)
    assert found[0] == "manifest steps are not 1..3: repeated [2], missing [3]"
    assert found[1:] == ["versions announced are not 0..3: missing [2, 3]", "no final announcement of version 3"]


def test_the_audit_finds_a_step_that_trained_groups_of_a_later_version() -> None:
    """As a chaos run once found: a restarted trainer redid step 10's manifest as step 7 (staleness -2)."""
    lines = [{"step": 6, "staleness_max": 1}, {"step": 7, "staleness_max": -2}, {"step": 8}]
    assert order_problems(lines) == ["step 7 trained groups released 2 versions after its own"]


def test_a_role_with_a_lost_group_fails_and_one_short_of_trials_says_so() -> None:
    ok = RunResult(0, ["trainer"], [Kill("trainer", 1, 5.0, 3)], 40.0, 0, {"outcome": "finished"}, Audit())
    lost = RunResult(1, ["trainer"], [Kill("trainer", 2, 5.0, 3)], 40.0, 0, {"outcome": "finished"}, Audit(lost=["p"]))
    assert role_row("trainer", [ok], 1)["verdict"] == "pass"
    assert role_row("trainer", [ok], 2)["verdict"] == "too few"
    row = role_row("trainer", [ok, lost], 2)
    assert row["verdict"] == "FAIL" and row["lost"] == 1 and row["completed"] == "2/2" and row["trials"] == 2


def test_reasons_of_one_kind_count_together() -> None:
    assert reason_kind("not a valid Scored message: logprobs[3] is nan: a logprob is finite and <= 0") == (
        "not a valid Scored message: logprobs[N] is nan: a logprob is finite and <= N"
    )
    assert reason_kind("n_samples is 0, must lie in [1, 65536]") == reason_kind(
        "n_samples is -7, must lie in [1, 65536]"
    )
