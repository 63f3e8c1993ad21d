"""`asyncrl chaos`, short, as `make test` runs it (`make chaos` is the long version): two roles SIGKILLed at
random moments of a real run, then poison on every topic and bad rows in the dataset of another; each run is read
back from its own topics."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipeline.chaos.kills import Settings, worker_run
from pipeline.chaos.poisoning import PoisonSettings, run_poison

pytestmark = pytest.mark.e2e


def test_sigkilled_rollout_and_trainer_lose_nothing_train_nothing_twice_and_leave_nothing(tmp_path: Path) -> None:
    steps, heard = 48, []  # long enough for both kills to land while it works (a restart takes ~8 s)
    # dropping groups without advantage (all of them: the model is untrained) as arith does: a restarted trainer
    # must count the drops of the manifests it redoes, else the prompt source releases too few and the run stalls
    settings = Settings(tmp_path, steps=steps, overrides=("trainer.skip_uniform_groups=16",))
    result = worker_run(settings, ["rollout", "trainer"], 0, random.Random(0), heard.append)
    assert [kill.role for kill in result.kills] == ["rollout", "trainer"] and heard == result.kills
    assert all(0 < kill.trainer_step < steps for kill in result.kills)  # each landed while the run worked
    assert result.completed, (result.error, result.summary)
    assert result.audit is not None and result.audit.ok, result.audit
    assert result.audit.trained_groups == steps * 4 and result.leftover == []
    assert result.summary["groups_dropped"] == result.audit.dropped_groups > 0  # the redone manifests' counted
    [run_dir] = (tmp_path / "runs").glob("*/latest")
    logs = [path.name.split("-")[0] for path in (run_dir / "logs").glob("*.jsonl")]
    assert sorted(logs) == [
        "prompts",
        "reward",
        "rollout",
        "rollout",
        "trainer",
        "trainer",
    ]  # each killed one restarted


def test_poison_on_every_topic_and_bad_rows_are_dead_lettered_and_the_run_finishes(tmp_path: Path) -> None:
    settings = PoisonSettings(
        tmp_path, steps=12, batch_groups=4, n_samples=4, messages=500, bad_rows=30, eval_rows=8,
        warm=False, clean=False, timeout_s=300,
    )  # fmt: skip
    report = run_poison(settings)
    assert all(report["checks"].values()), [name for name, held in report["checks"].items() if not held]
    poisoned = report["poisoned"]
    assert poisoned["poison_sent"]["random"] == 500 and poisoned["poison_sent"]["table_kinds"] >= 35
    assert poisoned["dataset"]["dead_lettered"] == 30 and poisoned["worker_processes"] == {
        "prompts": 1, "rollout": 1, "reward": 1, "trainer": 1,
    }  # fmt: skip
    reasons = " | ".join(poisoned["dead_letters_by_reason"])
    for expected in ("logprobs[N] is nan", "reward is nan", "unsigned announcement", "the model's vocabulary",
                     "UnicodeDecodeError", "not UTFN", "nested too deeply", "lone surrogate"):  # fmt: skip
        assert expected in reasons, expected
