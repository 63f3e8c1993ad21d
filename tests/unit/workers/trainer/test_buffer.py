"""The trainer's admission rules: at most once, whole groups, oldest first, stale groups dropped."""

import msgspec

from schemas.messages import DroppedGroup, PromptGroup, Scored
from tests import factories
from workers.trainer.buffer import GroupBuffer


def scored(prompt_id: str, sample: int, release_index: int = 0, version: int = 0, n: int = 2) -> Scored:
    group = release(prompt_id, version, release_index, n)
    return factories.scored(group=group, sample=sample, attempt="w:0", completion_tokens=[2], logprobs=[-0.5])


def release(prompt_id: str, version: int = 0, release_index: int = 0, n: int = 2) -> PromptGroup:
    return PromptGroup(
        prompt_id=prompt_id, row_index=0, epoch=0, release_index=release_index, released_at_version=version,
        prompt_text="1", prompt_tokens=[1], answer="2", n_samples=n,
    )  # fmt: skip


def fill(buffer: GroupBuffer, prompt_id: str, release_index: int, version: int = 0) -> None:
    for sample in range(2):
        buffer.add(scored(prompt_id, sample, release_index, version), (0, release_index * 2 + sample))


def test_a_trajectory_is_accepted_once():
    buffer = GroupBuffer()
    assert buffer.add(scored("p", 0), (0, 0))
    assert not buffer.add(scored("p", 0), (0, 1))  # delivered twice
    buffer.add(scored("p", 1), (0, 2))
    [group], _ = buffer.take(1, trainer_version=0, max_staleness=0)
    assert [s.trajectory_id for s, _ in group.trajectories()] == ["p/0", "p/1"]
    assert not buffer.add(scored("p", 0), (0, 3))  # already trained


def test_only_complete_groups_oldest_first():
    buffer = GroupBuffer()
    fill(buffer, "newer", release_index=5)
    buffer.add(scored("incomplete", 0, release_index=0), (0, 99))
    fill(buffer, "older", release_index=3)
    batch, dropped = buffer.take(2, trainer_version=0, max_staleness=4)
    assert [g.prompt_id for g in batch] == ["older", "newer"] and dropped == []
    assert buffer.take(1, trainer_version=0, max_staleness=4) == ([], [])  # "incomplete" waits


def test_no_batch_until_enough_groups():
    buffer = GroupBuffer()
    fill(buffer, "a", 0)
    assert buffer.take(2, trainer_version=0, max_staleness=0) == ([], [])
    fill(buffer, "b", 1)
    assert len(buffer.take(2, trainer_version=0, max_staleness=0)[0]) == 2


def test_stale_groups_are_dropped_with_a_reason():
    buffer = GroupBuffer()
    fill(buffer, "stale", 0, version=1)
    fill(buffer, "fresh", 1, version=4)
    batch, dropped = buffer.take(1, trainer_version=6, max_staleness=4)
    assert [g.prompt_id for g in batch] == ["fresh"]
    assert [d.prompt_id for d in dropped] == ["stale"] and "staleness 5 > max_staleness 4" in dropped[0].reason
    assert not buffer.add(scored("stale", 0, 0, 1), (0, 50))  # a dropped group stays dropped


def test_exact_rebuild_and_resume_positions():
    buffer = GroupBuffer(done_trajectories={"old/0", "old/1"})
    assert not buffer.add(scored("old", 0), (0, 0))
    fill(buffer, "x", 2)
    fill(buffer, "y", 3)
    assert buffer.oldest_positions() == {0: 4}
    assert buffer.take_exact(["y/0", "z/0"]) is None  # z not here yet
    [group] = buffer.take_exact(["y/0", "y/1"])
    assert group.prompt_id == "y" and buffer.oldest_positions() == {0: 4}


def test_exact_rebuild_keeps_the_manifests_group_order():
    buffer = GroupBuffer()
    for prompt_id, release in (("b", 0), ("a", 1), ("c", 2)):
        fill(buffer, prompt_id, release)
    groups = buffer.take_exact(["c/0", "c/1", "a/0", "a/1", "b/0", "b/1"])  # the step's rows, in order
    assert [g.prompt_id for g in groups] == ["c", "a", "b"]


def test_the_trainer_waits_for_a_group_at_its_deadline_instead_of_stepping_past_it():
    buffer = GroupBuffer()
    buffer.note_release(release("straggler", 0))  # released at v0: must train by v4 (eta = 4)
    buffer.note_release(release("quick", 1, release_index=1))
    fill(buffer, "quick", 1, version=1)
    buffer.add(scored("straggler", 0, release_index=0, version=0), (0, 9))  # one sample still generating
    # at v3 the straggler is not due yet: the complete group trains
    assert [g.prompt_id for g in buffer.take(1, trainer_version=3, max_staleness=4)[0]] == ["quick"]
    # at v4 it is due: no batch until it is complete, and nothing is dropped
    assert buffer.take(1, trainer_version=4, max_staleness=4) == ([], [])
    fill(buffer, "newer", 9, version=4)
    assert buffer.take(1, trainer_version=4, max_staleness=4) == ([], [])
    buffer.add(scored("straggler", 1, release_index=0, version=0), (0, 10))
    assert [g.prompt_id for g in buffer.take(1, trainer_version=4, max_staleness=4)[0]] == ["straggler"]


def test_a_ready_batch_held_back_by_a_due_straggler_is_told_from_waiting_for_generation():
    buffer = GroupBuffer()
    buffer.note_release(release("straggler", 0))
    buffer.add(scored("straggler", 0, release_index=0, version=0), (0, 0))  # one of its two samples
    fill(buffer, "quick", 1, version=1)
    assert not buffer.held_by_straggler(2, trainer_version=4, max_staleness=4)  # one ready group: generation
    assert not buffer.held_by_straggler(1, trainer_version=3, max_staleness=4)  # not due: "quick" trains
    assert buffer.held_by_straggler(1, trainer_version=4, max_staleness=4)  # due, with a batch ready behind it
    buffer.add(scored("straggler", 1, release_index=0, version=0), (0, 1))
    assert not buffer.held_by_straggler(1, trainer_version=4, max_staleness=4)


def test_a_release_seen_too_late_is_dropped_not_waited_for():
    buffer = GroupBuffer()
    buffer.note_release(release("never-complete", 0))
    batch, dropped = buffer.take(1, trainer_version=5, max_staleness=4)
    assert batch == [] and [d.prompt_id for d in dropped] == ["never-complete"]
    buffer.note_release(release("never-complete", 0))  # a redelivered release changes nothing
    assert buffer.take(1, trainer_version=5, max_staleness=4) == ([], [])


def test_a_trajectory_at_odds_with_its_release_is_refused_and_the_real_ones_complete_it():
    buffer = GroupBuffer()
    assert buffer.note_release(release("p", 0)) is None
    assert buffer.disagreement(scored("p", 0, version=2)) == "released_at_version 2 differs from its release's 0"
    assert buffer.disagreement(scored("p", 0, n=3)) == "n_samples 3 differs from its release's 2"  # forged, first
    assert buffer.disagreement(scored("p", 1, release_index=4)).startswith("release_index 4 differs")
    buffer.add(scored("p", 0), (0, 0))
    assert buffer.disagreement(scored("p", 0, n=3)) is None  # a copy of a buffered one: `add` ignores it
    assert buffer.disagreement(scored("p", 1)) is None
    buffer.add(scored("p", 1), (0, 1))
    assert [g.prompt_id for g in buffer.take(1, trainer_version=0, max_staleness=0)[0]] == ["p"]


def test_before_its_release_is_read_the_first_trajectory_sets_the_group_and_the_release_then_overrules_it():
    buffer = GroupBuffer()
    forged = scored("p", 0, n=3)
    assert buffer.add(forged, (0, 0))
    assert buffer.disagreement(scored("p", 1)) == "n_samples differs from the 1 trajectories buffered for its group"
    assert buffer.note_release(release("p", 0)) is None  # the forged member is let go, its id forgotten
    assert buffer.disagreement(scored("p", 1)) is None and buffer.disagreement(forged) is not None
    assert buffer.add(scored("p", 0), (0, 1)) and buffer.add(scored("p", 1), (0, 2))
    [group], _ = buffer.take(1, trainer_version=0, max_staleness=0)
    assert [(s.n_samples, where) for s, where in group.trajectories()] == [(2, (0, 1)), (2, (0, 2))]


def test_a_second_release_of_a_group_that_contradicts_the_first_is_refused_and_changes_nothing():
    buffer = GroupBuffer()
    assert buffer.note_release(release("p", 0)) is None
    assert buffer.note_release(release("p", 0)) is None  # redelivered: the same facts
    assert buffer.note_release(release("p", 0, n=5)) == "n_samples differs from the release of 'p' already read"
    fill(buffer, "p", 0)
    assert [g.prompt_id for g in buffer.take(1, trainer_version=0, max_staleness=0)[0]] == ["p"]
    assert buffer.note_release(release("p", 0, n=7)) is None  # done: ignored


def test_with_skip_uniform_a_group_without_advantage_is_dropped_and_the_next_one_trains():
    buffer = GroupBuffer()
    fill(buffer, "uniform", release_index=0)  # both samples scored 1.0
    buffer.add(msgspec.structs.replace(scored("mixed", 0, 1), reward=0.0), (0, 2))
    buffer.add(scored("mixed", 1, 1), (0, 3))
    assert [g.prompt_id for g in buffer.take(1, 0, 4)[0]] == ["uniform"]  # off: the oldest trains, as ever
    buffer = GroupBuffer()
    fill(buffer, "uniform", release_index=0)
    buffer.add(scored("incomplete", 0, 2), (0, 4))  # one of its two samples: not judged before it is complete
    assert buffer.take(1, 0, 4, skip_uniform=2) == ([], [DroppedGroup(prompt_id="uniform", reason=UNIFORM_REASON)])
    buffer.add(msgspec.structs.replace(scored("mixed", 0, 1), reward=0.0), (0, 2))
    buffer.add(scored("mixed", 1, 1), (0, 3))
    [group], dropped = buffer.take(1, 0, 4, skip_uniform=2)
    assert group.prompt_id == "mixed" and dropped == []
    assert not buffer.add(scored("uniform", 0), (0, 5))  # done: a copy delivered again is not taken


UNIFORM_REASON = "uniform: all 2 samples scored 1 (no advantage)"


def test_at_most_skip_uniform_groups_are_dropped_per_version_then_uniform_ones_train():
    buffer = GroupBuffer()
    for index, prompt_id in enumerate(["u0", "u1", "u2", "u3"]):
        fill(buffer, prompt_id, release_index=index)
    batch, dropped = buffer.take(1, 0, 4, skip_uniform=1)
    assert [g.prompt_id for g in batch] == ["u1"] and [d.prompt_id for d in dropped] == ["u0"]  # the oldest one
    batch, dropped = buffer.take(1, 0, 4, skip_uniform=1)
    assert [g.prompt_id for g in batch] == ["u2"] and dropped == []  # version 0 has dropped its one
    batch, dropped = buffer.take(1, 1, 4, skip_uniform=1)
    assert batch == [] and [d.prompt_id for d in dropped] == ["u3"]  # a new version may drop one again
