import msgspec

from pipeline.config import load_config
from pipeline.demo_model import build_tokenizer
from schemas.messages import WeightVersion
from workers.prompt_source import INITIAL, Source
from workers.rows import Row
from workers.staleness import admissible, may_release, skips_ahead


def test_release_window_is_eta_plus_one_batches_ahead():
    # B = 8, eta = 4, version 0: groups 0..39 may be released, the 41st may not
    assert may_release(39, version=0, batch_groups=8, max_staleness=4, dropped=0)
    assert not may_release(40, version=0, batch_groups=8, max_staleness=4, dropped=0)
    # each new version opens one batch more
    assert may_release(40, version=1, batch_groups=8, max_staleness=4, dropped=0)
    assert not may_release(48, version=1, batch_groups=8, max_staleness=4, dropped=0)


def test_dropped_groups_free_their_slots():
    assert not may_release(40, version=0, batch_groups=8, max_staleness=4, dropped=0)
    assert may_release(42, version=0, batch_groups=8, max_staleness=4, dropped=3)
    assert not may_release(43, version=0, batch_groups=8, max_staleness=4, dropped=3)


def test_eta_zero_is_synchronous():
    # only the batch of the current version may be out
    assert may_release(7, version=0, batch_groups=8, max_staleness=0, dropped=0)
    assert not may_release(8, version=0, batch_groups=8, max_staleness=0, dropped=0)
    assert may_release(8, version=1, batch_groups=8, max_staleness=0, dropped=0)


def test_admission_at_training_time():
    assert admissible(trainer_version=8, released_at_version=4, max_staleness=4)
    assert not admissible(trainer_version=9, released_at_version=4, max_staleness=4)
    assert admissible(trainer_version=3, released_at_version=3, max_staleness=0)
    assert not admissible(trainer_version=4, released_at_version=3, max_staleness=0)


def test_max_in_flight_caps_the_groups_out_below_etas_window():
    # B = 8, eta = 8 would let 72 out at version 0; at most 24 released and not yet trained (version * B) or dropped
    assert may_release(23, version=0, batch_groups=8, max_staleness=8, dropped=0, max_in_flight=24)
    assert not may_release(24, version=0, batch_groups=8, max_staleness=8, dropped=0, max_in_flight=24)
    assert may_release(31, version=1, batch_groups=8, max_staleness=8, dropped=0, max_in_flight=24)
    assert not may_release(32, version=1, batch_groups=8, max_staleness=8, dropped=0, max_in_flight=24)
    assert may_release(33, version=1, batch_groups=8, max_staleness=8, dropped=2, max_in_flight=24)
    # a cap wider than eta's window changes nothing; 0 is no cap
    assert not may_release(40, version=0, batch_groups=8, max_staleness=4, dropped=0, max_in_flight=100)
    assert may_release(71, version=0, batch_groups=8, max_staleness=8, dropped=0, max_in_flight=0)


def test_the_prompt_source_keeps_to_max_in_flight(tmp_path):
    build_tokenizer(tmp_path / "model")
    overrides = ["trainer.batch_groups=2", "trainer.max_staleness=8", "trainer.max_in_flight=3"]
    config = load_config(None, [f"runs_dir={tmp_path}", f"model.path={tmp_path / 'model'}", *overrides])
    source = Source(config, [Row(i, f"{i}+1=", str(i + 1), {}) for i in range(20)], released=[])

    def release_all(version: WeightVersion) -> int:
        while source.may_release(version):
            source.next_group(version)
        return source.released

    assert release_all(INITIAL) == 3  # eta alone would let 18 out
    trained_one = msgspec.structs.replace(INITIAL, version=1, groups_consumed=2)
    assert release_all(trained_one) == 5  # 1 * B + 3
    assert release_all(msgspec.structs.replace(trained_one, groups_dropped=1)) == 6


def test_skips_ahead_is_one_version_of_the_trainer_s_recent_skips():
    # 10 skips per version over versions 2..5, then 4 at version 6: (40 - 6) / 4 versions, rounded down
    skipped_by = {2: 6, 3: 16, 4: 26, 5: 36, 6: 40}
    assert skips_ahead(skipped_by, version=6, max_staleness=4) == 8
    assert skips_ahead(skipped_by, version=6, max_staleness=0) == 0  # synchronous: nothing released ahead
    assert skips_ahead({6: 40}, version=6, max_staleness=4) == 0  # one version seen (a restart): no rate yet
    assert skips_ahead({2: 6, 3: 16}, version=4, max_staleness=4) == 0  # this version not announced yet
    assert skips_ahead({0: 0, 1: 1, 2: 3}, version=2, max_staleness=1) == 1  # 1.5 a version, rounded down
    assert skips_ahead({20: 1, 30: 21}, version=30, max_staleness=4) == 0  # version 20 is past the window (8)
    assert skips_ahead({5: 10, 6: 4}, version=6, max_staleness=4) == 0  # a count that went back: none ahead


def test_skips_ahead_widen_eta_s_window_but_not_the_in_flight_cap():
    assert may_release(43, version=0, batch_groups=8, max_staleness=4, dropped=0, ahead=4)
    assert not may_release(44, version=0, batch_groups=8, max_staleness=4, dropped=0, ahead=4)
    assert may_release(45, version=0, batch_groups=8, max_staleness=4, dropped=2, ahead=4)
    assert not may_release(24, version=0, batch_groups=8, max_staleness=8, dropped=0, max_in_flight=24, ahead=5)


def test_the_prompt_source_releases_ahead_of_the_trainer_s_skips(tmp_path):
    build_tokenizer(tmp_path / "model")
    config = load_config(None, [f"runs_dir={tmp_path}", f"model.path={tmp_path / 'model'}", "trainer.steps=100"])
    source = Source(config, [Row(i, f"{i}+1=", str(i + 1), {}) for i in range(500)], released=[])
    B, eta = config.trainer.batch_groups, config.trainer.max_staleness  # the demo's: 8 and 4

    def release_all(version: WeightVersion) -> int:
        source.follow(version)
        while source.may_release(version):
            source.next_group(version)
        return source.released

    assert release_all(INITIAL) == (eta + 1) * B
    # version 1: 8 trained, 6 skipped and replaced, and 6 more released ahead of the next version's skips
    v1 = msgspec.structs.replace(INITIAL, version=1, groups_consumed=8, groups_dropped=6, groups_skipped=6)
    assert release_all(v1) == (eta + 2) * B + 6 + 6
    # a stale drop frees its slot, but no skip is expected for it: 12 skipped over 2 versions, 6 a version
    v2 = msgspec.structs.replace(v1, version=2, groups_consumed=16, groups_dropped=13, groups_skipped=12)
    assert release_all(v2) == (eta + 3) * B + 13 + 6


def test_releasing_ahead_never_passes_what_the_run_can_train(tmp_path):
    build_tokenizer(tmp_path / "model")
    config = load_config(None, [f"runs_dir={tmp_path}", f"model.path={tmp_path / 'model'}", "trainer.steps=6"])
    source = Source(config, [Row(i, f"{i}+1=", str(i + 1), {}) for i in range(500)], released=[])
    source.follow(INITIAL)
    v1 = msgspec.structs.replace(INITIAL, version=1, groups_consumed=8, groups_dropped=6, groups_skipped=6)
    source.follow(v1)
    while source.may_release(v1):
        source.next_group(v1)
    assert source.released == 6 * 8 + 6  # steps * B + dropped; eta's window with 6 ahead would allow 60


def test_a_restarted_source_numbers_its_releases_past_a_hole(tmp_path):
    """A crash in the middle of a release may deliver groups 0, 1 and 3 and not 2 (other partitions): the
    restarted source continues after row 3's release with index 4, never reusing one."""
    build_tokenizer(tmp_path / "model")
    config = load_config(None, [f"runs_dir={tmp_path}", f"model.path={tmp_path / 'model'}"])
    rows = [Row(i, f"{i}+1=", str(i + 1), {}) for i in range(20)]
    first = Source(config, rows, released=[])
    groups = [first.next_group(INITIAL) for _ in range(4)]
    again = Source(config, rows, released=[groups[0], groups[1], groups[3]])
    assert again.released == 3  # N of the bound counts what `prompts` holds
    after = again.next_group(INITIAL)
    assert after.release_index == 4 and after.row_index == first.next_group(INITIAL).row_index
