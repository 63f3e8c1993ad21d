"""Evaluation during a whole run, as users run it: `asyncrl run` on rows of one's own (reward math) with a
held-out JSONL of one's own; the eval lines, summary.json and curves.png come from the run itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

STEPS, EVERY, K = 4, 2, 2


def test_own_jsonl_run_evaluates_its_eval_source(broker, tmp_path: Path, unique_name) -> None:
    from pipeline.demo_model import build_model, build_tokenizer

    model = tmp_path / "model"
    build_model(model, build_tokenizer(model), seed=0)
    rows = [json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) for a in range(10, 30) for b in range(3)]
    (tmp_path / "train.jsonl").write_text("\n".join(rows[:40]) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(rows[40:]) + "\n")
    overrides = [
        f"model.path={model}",
        f"data.source={tmp_path / 'train.jsonl'}",
        f"data.eval_source={tmp_path / 'eval.jsonl'}",
        "data.reward=math",
        f"trainer.steps={STEPS}",
        "trainer.batch_groups=2",
        "data.n_samples=2",
        "rollout.max_new_tokens=6",
        f"eval.every={EVERY}",
        f"eval.k={K}",
        f"runs_dir={tmp_path / 'runs'}",
        f"broker.bootstrap={broker.bootstrap}",
        f"broker.topic_prefix={unique_name('eval')}.",
    ]
    command = [sys.executable, "-m", "pipeline.cli", "run", *overrides, "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = (tmp_path / "runs" / "latest").resolve()

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if line["source"] == "eval"]
    assert [line["version"] for line in evals] == [0, 2, 4]  # the base model, every EVERY versions, the last
    for line in evals:
        assert line["n"] == 20 and line["k"] == K and line["pass_at_1"] <= line["pass_at_k"]
        assert len((run_dir / "eval" / f"v{line['version']:06d}.jsonl").read_text().splitlines()) == 20
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["base_accuracy"] is not None and summary["final_accuracy"] == evals[-1]["heldout_accuracy"]
    assert summary["eval_k"] == K and summary["final_maj_at_k"] == evals[-1]["maj_at_k"]
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert "no evaluation set" not in done.stderr
    assert (run_dir / "logs" / "eval-0.stdout").exists()  # scored by the run's evaluator process
    first_step = next(line["time"] for line in lines if line["source"] == "trainer")
    assert evals[0]["time"] > first_step  # it starts once the trainer has stepped: the workers' start-up is over
    assert sorted(path.name for path in (run_dir / "eval" / "queue").iterdir()) == ["done"]  # all of it scored


@pytest.mark.parametrize(("reward", "kind"), [("hangs_on_marked", "timeout"), ("exits_on_marked", "died")])
def test_a_reward_that_hangs_or_exits_during_evaluation_costs_calls_not_the_run(
    broker, tmp_path: Path, unique_name, reward: str, kind: str
) -> None:
    """A quarter of the held-out rows make the reward hang, or end its process with os._exit: each such call
    fails (its kind counted in summary.json), the evaluations stand, and the run finishes in its time."""
    from pipeline.demo_model import build_model, build_tokenizer
    from pipeline.launch.local_run import EVAL_MARGIN_S

    model = tmp_path / "model"
    build_model(model, build_tokenizer(model), seed=0)
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10, 30) for b in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:40]))
    held_out = [row | {"misbehave": i % 4 == 0} for i, row in enumerate(rows[40:])]  # 5 of 20
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in held_out))
    max_wall_s = 240
    overrides = [
        f"model.path={model}",
        f"data.source={tmp_path / 'train.jsonl'}",
        f"data.eval_source={tmp_path / 'eval.jsonl'}",
        f"data.reward={Path(__file__).parents[1] / 'integration' / 'bad_rewards.py'}:{reward}",
        "reward.timeout_s=2",
        f"trainer.steps={STEPS}",
        "trainer.batch_groups=2",
        "data.n_samples=2",
        "rollout.max_new_tokens=6",
        f"eval.every={EVERY}",
        f"max_wall_s={max_wall_s}",
        f"runs_dir={tmp_path / 'runs'}",
        f"broker.bootstrap={broker.bootstrap}",
        f"broker.topic_prefix={unique_name('eval')}.",
    ]
    command = [sys.executable, "-m", "pipeline.cli", "run", *overrides, "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=max_wall_s + EVAL_MARGIN_S + 60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = (tmp_path / "runs" / "latest").resolve()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["reason"] is None
    assert summary["base_accuracy"] is not None and summary["final_accuracy"] is not None
    assert summary["eval_failures"] == {kind: 5 * 3} and summary["evals_failed"] == []  # versions 0, 2, 4
    assert summary["reward_failures"] == {}  # the training rows are not marked
    assert summary["wall_seconds"] < max_wall_s + EVAL_MARGIN_S
    rows = [json.loads(line) for line in (run_dir / "eval" / f"v{STEPS:06d}.jsonl").read_text().splitlines()]
    assert [bool(row["errors"]) for row in rows] == [i % 4 == 0 for i in range(20)]
    assert all(kind in row["errors"][0] for row in rows if row["errors"])  # 'timeout: ...', 'the ... died'
