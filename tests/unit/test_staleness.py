import msgspec

from pipeline.config import load_config
from pipeline.demo_model import build_tokenizer
from schemas.messages import WeightVersion
from workers.prompt_source import INITIAL, Source
from workers.rows import Row
from workers.staleness import admissible, may_release


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
