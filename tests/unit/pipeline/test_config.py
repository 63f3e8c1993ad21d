"""Config loading: every shipped config loads, overrides apply, bad values are named clearly."""

from pathlib import Path

import pytest
import yaml

import pipeline
from pipeline.cli import main
from pipeline.config import LEGACY_NAMES, ConfigError, explain, load_config, on_one_machine, resolve, save_config

SHIPPED = sorted((Path(pipeline.__file__).parent / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path)


def test_overrides_are_typed():
    config = load_config(None, ["trainer.optim.lr=3e-4", "rollout.interrupt=false", "trainer.max_staleness=0"])
    assert config.trainer.optim.lr == 3e-4 and config.rollout.interrupt is False and config.trainer.max_staleness == 0


def test_round_trip_through_yaml(tmp_path):
    config = load_config(None, ["name=x", "trainer.steps=7"])
    save_config(config, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == config


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1", "unknown field `lrr` - at `$.trainer`"),
        ("trainer.optim.lrr=1", "unknown field `lrr` - at `$.trainer.optim`"),
        ("trainer.optim.lr=-1", "at `$.trainer.optim.lr`"),
        ("trainer.lr=-1", "at `$.trainer.optim.lr`"),  # an old name fails where it lives now
        ("trainer.loss.objective=ppo2", "at `$.trainer.loss.objective`"),
        ("trainer.microbatch=random", "at `$.trainer.microbatch.mode`"),
        ("rollout.top_p=0", "at `$.rollout.top_p`"),
        ("name=a/b", "plain directory name"),
        ("data.reward=nonsense", "module:function"),
        ("data.source=rows.jsonl", "verifies the built-in task only"),
        ("data.source=rows.jsonl data.reward=math", "needs model.path"),
        ("trainer.optim.minibatches=1000", "cannot exceed"),
        ("rollout.workers=3", "needs broker.partitions >= 3"),
        ("rollout.backend=vllm rollout.cache_lag=1", "needs rollout.backend=torch"),
        ("trainer", "section.key=value"),
        ("trainer.optim.lr.x=1", "is a value, not a section"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=None) as info:
        nested = override.startswith("trainer.optim.lr.")
        load_config(None, ["trainer.optim.lr=1e-4", override] if nested else override.split())
    assert message in str(info.value)


def test_a_bad_value_is_traced_to_the_override_or_the_file_that_set_it(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("profile: {start: -1}\ntrainer: {steps: 5}\n")
    with pytest.raises(ConfigError) as from_override:
        load_config(config, ["profile.start=2", "profile.roles=[trainer,reward]"])
    assert str(from_override.value).startswith("invalid config (override 'profile.roles=[trainer,reward]'): ")
    with pytest.raises(ConfigError) as from_file:  # the override sets another field of the same section
        load_config(config, ["profile.steps=3"])
    assert str(from_file.value).startswith(f"invalid config in {config}: ") and "$.profile.start" in str(
        from_file.value
    )
    with pytest.raises(ConfigError) as from_section:  # a whole section given as one override
        load_config(None, ["trainer={steps: 0}"])
    assert "(override 'trainer={steps: 0}')" in str(from_section.value)


def test_bad_yaml_file_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_every_field_is_described():
    for line in explain(load_config()).splitlines():
        assert line.split("# ", 1)[1].strip(), f"undocumented field: {line}"


def test_dry_run_shows_the_values_that_run(capsys, tmp_path):
    assert main(["run", "--dry-run", f"runs_dir={tmp_path}", "trainer.optim.lr=5e-5"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["trainer"]["steps"] == 600  # the demo config's, not the schema default
    assert shown["trainer"]["optim"]["lr"] == 5e-5 and shown["broker"]["fetch_wait_ms"] == 50
    assert shown["trainer"]["checkpoint"]["weights_dir"] == str(tmp_path / "arith" / "weights")
    assert main(["run", "--dry-run", "--explain", "trainer.max_staleness=0"]) == 0
    explained = capsys.readouterr().out
    assert "trainer.steps = 600  # " in explained and "broker.fetch_wait_ms = 20  # " in explained


def test_resolve_is_idempotent_and_keeps_what_was_set():
    config = resolve(load_config(None, ["broker.fetch_wait_ms=7", "trainer.checkpoint.weights_dir=/shared/w"]))
    assert config.broker.fetch_wait_ms == 7 and config.trainer.checkpoint.weights_dir == "/shared/w"
    assert resolve(config) == config


def test_fetch_wait_follows_the_staleness_bound_unless_set():
    wait = lambda *overrides: resolve(load_config(None, list(overrides))).broker.fetch_wait_ms  # noqa: E731
    assert wait("trainer.max_staleness=0") == 20  # synchronous: every hop is on the critical path
    assert wait("trainer.max_staleness=4") == 50
    assert wait("trainer.max_staleness=0", "broker.fetch_wait_ms=7") == 7


def test_a_role_s_only_worker_reads_alone_under_asyncrl_run_only():
    sole = lambda config: config.broker.sole_consumers  # noqa: E731
    assert sole(resolve(on_one_machine(load_config(None, [])))) is True  # the launcher starts every worker
    assert sole(resolve(on_one_machine(load_config(None, ["broker.sole_consumers=false"])))) is False
    assert sole(resolve(load_config(None, []))) is False  # compose or Slurm: a role's workers may be scaled
    assert sole(resolve(load_config(None, ["broker.sole_consumers=true"]))) is True


# Every old name with a value it can take, and that value where the name lives now.
OLD = {
    "trainer.lr": 3e-4,
    "trainer.weight_decay": 0.1,
    "trainer.grad_clip": 0.5,
    "trainer.minibatches": 2,
    "trainer.objective": "naive",
    "trainer.advantage": "rloo",
    "trainer.clip_eps": 0.3,
    "trainer.clip_eps_high": 0.4,
    "trainer.behaviour_weight_cap": 2.0,
    "trainer.behaviour_weight_mode": "mask",
    "trainer.behaviour_weight_level": "sequence",
    "trainer.loss_aggregation": "seq_mean",
    "trainer.kl_coef": 0.01,
    "trainer.microbatch": "fixed",
    "trainer.max_tokens_per_microbatch": 64,
    "trainer.min_microbatches": 2,
    "trainer.microbatches_fixed": 3,
    "trainer.checkpoint_every": 7,
    "trainer.keep_checkpoints": 5,
    "trainer.keep_versions": 6,
    "trainer.weights_dir": "/shared/w",
    "trainer.warmup_steps": 0,
}


def value_at(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def test_the_old_names_are_all_tested():
    assert OLD.keys() == LEGACY_NAMES.keys()


def test_old_names_in_overrides_map_to_their_new_place_with_one_line_each(capsys):
    config = load_config(None, [f"{old}={value}" for old, value in OLD.items()] + ["trainer.lr=5e-4"])
    for old, value in OLD.items():
        assert value_at(config, LEGACY_NAMES[old]) == (5e-4 if old == "trainer.lr" else value), old
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(OLD)  # trainer.lr twice: one line
    assert "asyncrl: trainer.lr is now trainer.optim.lr (the old name still works)" in lines
    assert "asyncrl: trainer.microbatch is now trainer.microbatch.mode (the old name still works)" in lines


def test_a_config_file_an_older_version_wrote_loads(tmp_path, capsys):
    old = {"trainer": {**{k.split(".")[1]: v for k, v in OLD.items()}, "steps": 9}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    config = load_config(path, ["trainer.microbatch.max_tokens=32"])
    assert config.trainer.steps == 9 and config.trainer.microbatch.max_tokens == 32
    for name, value in OLD.items():
        if name != "trainer.max_tokens_per_microbatch":
            assert value_at(config, LEGACY_NAMES[name]) == value, name
    assert "trainer.keep_checkpoints is now trainer.checkpoint.keep" in capsys.readouterr().err


def test_new_names_load_quietly(capsys):
    config = load_config(
        None,
        [
            "trainer.microbatch.mode=fixed",
            "trainer.microbatch.fixed_count=4",
            "trainer.checkpoint.every=3",
            "trainer.loss.aggregation=token_sum_norm",
            "model.warmup_steps=0",
        ],
    )
    assert (config.trainer.microbatch.mode, config.trainer.microbatch.fixed_count) == ("fixed", 4)
    assert config.trainer.checkpoint.every == 3 and config.trainer.loss.aggregation == "token_sum_norm"
    assert config.model.warmup_steps == 0 and capsys.readouterr().err == ""


def test_an_old_and_a_new_name_for_one_setting_in_a_file_is_an_error(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("trainer:\n  lr: 1.0e-3\n  optim:\n    lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=r"sets both trainer\.lr and trainer\.optim\.lr"):
        load_config(path)


@pytest.mark.parametrize("where", ["override", "file"])
def test_a_retired_name_says_what_replaces_it(tmp_path, where):
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  recompute_cache: false\n" if where == "file" else "{}\n")
    overrides = ["rollout.recompute_cache=false"] if where == "override" else []
    with pytest.raises(ConfigError, match=r"rollout\.recompute_cache is retired: use rollout\.cache_lag \("):
        load_config(path, overrides)


def test_shipped_configs_run_by_name():
    from pipeline.cli import config_file

    assert config_file(None).endswith("configs/arith.yaml")  # `asyncrl run` = the demo
    for name in ("arith", "chain"):
        config = load_config(config_file(name))
        assert config.data.task == name and config.name == name
    with pytest.raises(ConfigError, match="neither a config file nor a shipped config"):
        config_file("nosuch")
