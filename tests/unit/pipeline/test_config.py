"""Config loading: every shipped config loads, overrides apply, bad values are named clearly."""

import os
import re
from pathlib import Path

import msgspec
import pytest
import yaml

import pipeline
from pipeline.cli import main
from pipeline.config import ConfigError, explain, load_config, on_one_machine, resolve, save_config
from schemas.config import LauncherState

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
        ("trainer.loss.objective=ppo2", "at `$.trainer.loss.objective`"),
        ("rollout.top_p=0", "at `$.rollout.top_p`"),
        ("name=a/b", "plain directory name"),
        ("data.reward=nonsense", "module:function"),
        ("data.source=rows.jsonl", "verifies the built-in task only"),
        ("data.source=rows.jsonl data.reward=math", "needs model.path"),
        ("trainer.optim.minibatches=1000", "cannot exceed"),
        ("rollout.workers=3", "needs broker.partitions >= 3"),
        ("rollout.backend=vllm rollout.cache_lag=1", "needs rollout.backend=torch"),
        ("model.lora.rank=4 trainer.checkpoint.whole_every=2", "whole_every > 1 needs model.lora.rank 0"),
        ("trainer.loss.behaviour_weight_mode=icepop trainer.loss.behaviour_weight_cap=2", "no cap"),
        ("trainer.loss.icepop_low=2 trainer.loss.icepop_high=1", "icepop_low must be below"),
        ("trainer.loss.objective=m2po trainer.loss.behaviour_weight_level=sequence", "do not apply"),
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


def test_every_field_is_described_in_one_or_two_sentences():
    """Longer explanations belong in the docs, which a description names as `(docs: Page)`."""
    for line in explain(load_config()).splitlines():
        description = line.split("# ", 1)[1].strip()
        assert description, f"undocumented field: {line}"
        assert len(description) <= 200, f"over 200 characters: {line}"
        assert len(re.findall(r"[.!?]\s+[A-Z]", description)) <= 1, f"over two sentences: {line}"


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
    assert resolve(on_one_machine(load_config())).launcher.sole_consumers is True  # the launcher starts every worker
    assert resolve(load_config()).launcher.sole_consumers is False  # compose or Slurm: a role's workers may scale


@pytest.mark.parametrize("name", ["cores=2", "broker.embedded=true", "broker.sole_consumers=false"])
def test_launcher_state_given_by_a_config_is_one_line_saying_whose_it_is(tmp_path, name):
    key = name.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} is the launcher's, not a config's: "):
        load_config(None, [name])
    section, _, field = key.rpartition(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {field: 2}} if section else {field: 2}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} is the launcher's, not a config's \(in {path}\): "):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^launcher is what a launcher writes into a run's config.yaml"):
        load_config(None, ["launcher.sole_consumers=true"])


def test_a_run_s_config_yaml_run_again_gets_its_launcher_state_anew(tmp_path):
    """`asyncrl run runs/latest/config.yaml`: that run's cores and embedded broker are not this run's."""
    config = resolve(on_one_machine(load_config(None, [f"runs_dir={tmp_path}"])))
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config  # as its workers read it
    ran = msgspec.structs.replace(config, launcher=LauncherState(cores=99, embedded_broker=True, sole_consumers=False))
    ran = msgspec.structs.replace(ran, broker=msgspec.structs.replace(ran.broker, bootstrap="127.0.0.1:9"))
    again = on_one_machine(ran).launcher
    assert again.cores == len(os.sched_getaffinity(0)) and again.sole_consumers and again.embedded_broker
    assert not on_one_machine(resolve(load_config(None, ["broker.bootstrap=kafka:9092"]))).launcher.embedded_broker


def value_at(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


# Every name an older config may use, and the name to write now.
OLD = {
    **{f"trainer.{name}": f"trainer.optim.{name}" for name in ("lr", "weight_decay", "grad_clip", "minibatches")},
    **{
        f"trainer.{name}": f"trainer.loss.{name}"
        for name in (
            *("objective", "advantage", "clip_eps", "clip_eps_high", "kl_coef"),
            *("behaviour_weight_cap", "behaviour_weight_mode", "behaviour_weight_level"),
        )
    },
    "trainer.loss_aggregation": "trainer.loss.aggregation",
    "trainer.microbatch": "trainer.microbatch.mode",
    "trainer.max_tokens_per_microbatch": "trainer.microbatch.max_tokens",
    "trainer.min_microbatches": "trainer.microbatch.min_count",
    "trainer.microbatches_fixed": "trainer.microbatch.fixed_count",
    "trainer.checkpoint_every": "trainer.checkpoint.every",
    "trainer.keep_checkpoints": "trainer.checkpoint.keep",
    "trainer.keep_versions": "trainer.checkpoint.keep_versions",
    "trainer.weights_dir": "trainer.checkpoint.weights_dir",
    "trainer.warmup_steps": "model.warmup_steps",
}


@pytest.mark.parametrize("old, new", OLD.items(), ids=list(OLD))
def test_an_old_name_is_one_line_naming_the_new_one(tmp_path, old, new):
    with pytest.raises(ConfigError, match=rf"^{re.escape(old)} was renamed: use {re.escape(new)}$"):
        load_config(None, [f"{old}=1"])
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {key: 1}}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(old)} was renamed: use {re.escape(new)} \(in {path}\)$"):
        load_config(path)


def test_a_section_s_new_names_load():
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
    assert config.model.warmup_steps == 0


@pytest.mark.parametrize("where", ["override", "file"])
def test_a_retired_name_says_what_replaces_it(tmp_path, where):
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  recompute_cache: false\n" if where == "file" else "{}\n")
    overrides = ["rollout.recompute_cache=false"] if where == "override" else []
    with pytest.raises(ConfigError, match=r"rollout\.recompute_cache was renamed: use rollout\.cache_lag \("):
        load_config(path, overrides)


def test_shipped_configs_run_by_name():
    from pipeline.shipped_configs import config_file

    assert config_file(None).endswith("configs/arith.yaml")  # `asyncrl run` = the demo
    for name in ("arith", "chain"):
        config = load_config(config_file(name))
        assert config.data.task == name and config.name == name
    with pytest.raises(ConfigError, match="neither a config file nor a shipped config"):
        config_file("nosuch")


OLD_SPELLINGS = {
    "broker.fetch_wait_ms": "0",
    "model.warmup_steps": "null",
    "data.eval_source": "",
    "rollout.max_new_tokens": "0",
    "rollout.cache_lag": "null",
    "rollout.threads": "0",
    "trainer.threads": "0",
    "trainer.loss.clip_eps_high": "0.0",
    "trainer.checkpoint.weights_dir": "",
}


@pytest.mark.parametrize("name, old", OLD_SPELLINGS.items(), ids=list(OLD_SPELLINGS))
def test_automatic_is_spelled_auto_and_an_old_spelling_is_one_line(name, old):
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)}=.*: an automatic value is spelled {name}=auto$"):
        load_config(None, [f"{name}={old}"])
    assert value_at(load_config(None, [f"{name}=auto"]), name) == "auto"


def test_a_zero_that_means_zero_stays_a_zero():
    zeros = ["model.warmup_steps=0", "rollout.cache_lag=0", "rollout.top_k=0", "reward.processes=0", "eval.every=0"]
    config = resolve(load_config(None, zeros))
    assert (config.model.warmup_steps, config.rollout.cache_lag, config.reward.processes) == (0, 0, 0)


def test_resolve_leaves_nothing_automatic():
    for config in (load_config(), load_config(None, ["data.source=rows.jsonl", "data.reward=math", "model.path=m"])):
        resolved = resolve(on_one_machine(config))
        assert "'auto'" not in explain(resolved) and resolve(resolved) == resolved
    assert resolved.data.eval_source == "none"
    assert resolve(load_config()).data.eval_source == "builtin"
    assert resolve(load_config(None, ["trainer.loss.clip_eps=0.3"])).trainer.loss.clip_eps_high == 0.3


def test_a_run_on_ones_own_model_with_the_demo_learning_rate_is_warned_once(tmp_path):
    from pipeline.demo_model import DEMO_MARKER
    from pipeline.preflight import learning_rate_warning

    demo_dir = tmp_path / "runs" / "demo" / "model"
    own = load_config(None, [f"model.path={tmp_path}/smollm2"])
    warning = learning_rate_warning(own, demo_dir)
    assert warning.startswith("asyncrl: warning: trainer.optim.lr is 0.0001, the demo model's default")
    assert "trainer.optim.lr=5e-6" in warning and "\n" not in warning
    assert (
        learning_rate_warning(load_config(None, [f"model.path={tmp_path}/m", "trainer.optim.lr=2e-6"]), demo_dir)
        is None
    )
    assert learning_rate_warning(load_config(None, []), demo_dir) is None  # the demo model: its own rate
    lora = load_config(None, [f"model.path={tmp_path}/smollm2", "model.lora.rank=8"])
    assert learning_rate_warning(lora, demo_dir) is None  # an adapter's rate is about ten times a full fine-tune's
    assert learning_rate_warning(load_config(None, [f"model.path={demo_dir}"]), demo_dir) is None  # a demo resumed
    shared = tmp_path / "bench-models" / "seed0"  # a demo model a benchmark built once for its runs
    (shared / DEMO_MARKER).parent.mkdir(parents=True)
    (shared / DEMO_MARKER).write_text("{}")
    assert learning_rate_warning(load_config(None, [f"model.path={shared}"]), demo_dir) is None


def test_the_micro_batch_budget_resolves_per_device():
    assert resolve(load_config()).trainer.microbatch.max_tokens == 1024
    assert resolve(load_config(None, ["model.device=cuda"])).trainer.microbatch.max_tokens == 16384
    given = load_config(None, ["model.device=cuda", "trainer.microbatch.max_tokens=2048"])
    assert resolve(given).trainer.microbatch.max_tokens == 2048
