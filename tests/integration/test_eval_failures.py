"""An evaluation that fails costs the evaluation, never the run: a reward past its failure budget gives the version
up with the reason, and an evaluator still scoring past max_wall_s + EVAL_MARGIN_S is stopped, its versions noted
(with real scoring processes and a real evaluator process). The whole run: tests/e2e/test_eval_in_run.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

from pipeline import monitor
from pipeline.launch import local_run
from pipeline.launch.worker_processes import WorkerProcess
from tests.unit.workers.evaluator.test_eval_during_training import EVAL_ROWS, own_jsonl_config
from workers import runtime
from workers.evaluator.scoring import NOT_SCORED, Evaluator
from workers.evaluator.worker import EvalRequests, queue_dir, queued, score_version

BAD_REWARDS = Path(__file__).parent / "bad_rewards.py"


def test_an_evaluation_whose_reward_fails_past_its_budget_is_given_up_with_the_reason(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    config = own_jsonl_config(demo_model_dir, tmp_path, f"data.reward={BAD_REWARDS}:raises", "reward.failure_window=2")
    run_dir = runtime.run_dir(config)
    run_dir.mkdir()
    evaluator = Evaluator.for_config(config)
    try:
        assert asyncio.run(score_version(run_dir, evaluator, 0, None)) is None  # no accuracy: it was given up
    finally:
        evaluator.score.close()

    lines, _ = monitor.read_metrics(run_dir / "metrics.jsonl")
    [failed] = [line for line in lines if line["source"] == "eval_failed"]
    assert failed["version"] == 0 and failed["reason"].startswith("the reward function failed on 2 of the last 2")
    calls = failed["reward_failures"]["RuntimeError"]
    assert 2 <= calls < len(EVAL_ROWS)  # the calls left once the budget was spent were not made
    rows = [json.loads(line) for line in (run_dir / "eval" / "v000000.jsonl").read_text().splitlines()]
    errors = [error.split(": ", 1)[1] for row in rows for error in row["errors"]]
    assert len(errors) == len(EVAL_ROWS) and errors.count(NOT_SCORED) == len(EVAL_ROWS) - calls
    summary = monitor.finish(config, run_dir, "finished", time.time())
    assert summary["base_accuracy"] is None and summary["eval_failures"] == {"RuntimeError": calls}
    assert summary["evals_failed"] == [{"version": 0, "reason": failed["reason"]}]


def test_an_evaluator_still_scoring_past_max_wall_s_is_stopped_and_its_versions_noted(
    demo_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(local_run, "EVAL_MARGIN_S", 1.0)
    config = own_jsonl_config(demo_model_dir, tmp_path, "max_wall_s=1")
    run_dir = runtime.run_dir(config)
    run_dir.mkdir()
    run = local_run.LocalRun(config, run_dir, started=time.time())
    run.evaluation = EvalRequests(run_dir, runtime.weights_dir(config))
    run.evaluation.ask(0)
    evaluator = WorkerProcess("eval", 0, run_dir / "config.yaml", tmp_path / "eval.log")
    evaluator.process = subprocess.Popen(["sleep", "600"])  # an evaluator that never gets through its queue
    run.workers.append(evaluator)

    run.finish_evaluation()

    assert time.time() - run.started < 10 and evaluator.process.poll() is not None
    lines, _ = monitor.read_metrics(run_dir / "metrics.jsonl")
    [failed] = [line for line in lines if line["source"] == "eval_failed"]
    assert failed["version"] == 0 and "1 s past max_wall_s; stopped" in failed["reason"]
    assert queued(queue_dir(run_dir)) == []
