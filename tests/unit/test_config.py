"""Config loading: every shipped config loads, overrides apply, bad values are named clearly."""

from pathlib import Path

import pytest

import pipeline
from pipeline.config import ConfigError, explain, load_config, save_config

SHIPPED = sorted((Path(pipeline.__file__).parent / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path)


def test_overrides_are_typed():
    config = load_config(None, ["trainer.lr=3e-4", "rollout.interrupt=false", "trainer.max_staleness=0"])
    assert config.trainer.lr == 3e-4 and config.rollout.interrupt is False and config.trainer.max_staleness == 0


def test_round_trip_through_yaml(tmp_path):
    config = load_config(None, ["name=x", "trainer.steps=7"])
    save_config(config, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == config


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1", "unknown field `lrr` - at `$.trainer`"),
        ("trainer.lr=-1", "at `$.trainer.lr`"),
        ("trainer.objective=ppo2", "at `$.trainer.objective`"),
        ("rollout.top_p=0", "at `$.rollout.top_p`"),
        ("name=a/b", "plain directory name"),
        ("data.reward=nonsense", "module:function"),
        ("data.source=rows.jsonl", "verifies the built-in task only"),
        ("data.source=rows.jsonl data.reward=math", "needs model.path"),
        ("trainer.minibatches=1000", "cannot exceed"),
        ("rollout.workers=3", "needs broker.partitions >= 3"),
        ("trainer", "section.key=value"),
        ("trainer.lr.x=1", "is a value, not a section"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, ["trainer.lr=1e-4", override] if override.startswith("trainer.lr.") else override.split())
    assert message in str(info.value)


def test_bad_yaml_file_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_every_field_is_described():
    for line in explain().splitlines():
        assert line.split("# ", 1)[1].strip(), f"undocumented field: {line}"


def test_fetch_wait_follows_the_staleness_bound_unless_set():
    from workers.runtime import consumer_settings

    wait = lambda *overrides: consumer_settings(load_config(None, list(overrides)))["fetch_max_wait_ms"]
    assert wait("trainer.max_staleness=0") == 20  # synchronous: every hop is on the critical path
    assert wait("trainer.max_staleness=4") == 200
    assert wait("trainer.max_staleness=0", "broker.fetch_wait_ms=7") == 7
