"""The evaluator as the launcher starts it, in a process of its own at idle priority: the versions the monitor asks
for are scored, each `eval` line tagged with its version, and the report (summary.json, curves.png) shows them."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from pipeline import monitor
from pipeline.config import save_config
from pipeline.launch.worker_processes import WorkerProcess
from tests.unit.workers.evaluator.test_eval_during_training import EVAL_ROWS, own_jsonl_config
from workers import runtime
from workers.evaluator.scoring import Evaluator
from workers.evaluator.worker import EvalRequests
from workers.runtime import version_path
from workers.weights import unique_state_dict, write_version


def trainer_line(writer: runtime.MetricsWriter, step: int) -> None:
    writer.write(step=step, reward_mean=0.1 * step, staleness_mean=1.0, staleness_max=2, tokens_per_s=100.0)


def test_versions_asked_for_are_scored_by_the_evaluator_process_tagged_and_plotted(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """The queue as the launcher fills it (the base model, a version at eval.every, the last step's), scored
    by a real `asyncrl worker eval` under SCHED_IDLE, which exits once told there is nothing more to come."""
    config = own_jsonl_config(demo_model_dir, tmp_path, "eval.k=3")
    run_dir = runtime.run_dir(config)
    run_dir.mkdir()
    save_config(config, run_dir / "config.yaml")
    evaluator = Evaluator.for_config(config)
    scores, _ = asyncio.run(evaluator.score.score_all([(evaluator.rows[0], "15.0")]))
    assert scores == [(1.0, "15", "", "")]  # the run's reward: math, not exact text
    requests = EvalRequests(run_dir, runtime.weights_dir(config))
    requests.ask(0)  # what the launcher asks for before the workers start
    weights = unique_state_dict(evaluator.model)
    trainer = runtime.MetricsWriter(run_dir / "metrics.jsonl", "trainer")
    for step in range(1, 9):
        weights = {name: tensor * 1.01 for name, tensor in weights.items()}  # a new version each step
        write_version(weights, runtime.weights_dir(config), step, keep=4)
        trainer_line(trainer, step)
        if step == 2:
            requests.ask(2)  # as follow() does at eval.every; v2 is deleted at step 6, its link stays queued
    assert not version_path(runtime.weights_dir(config), 2).exists()
    requests.ask(monitor.final_version(run_dir), wait_s=0)  # as the launcher does once the trainer has stopped
    requests.close()

    evaluator_process = WorkerProcess("eval", 0, run_dir / "config.yaml", tmp_path / "eval.log", idle=True)
    evaluator_process.start()  # as the launcher starts it
    # idle from its first instruction (before its imports): it never takes a core from the trainer or the rollout
    assert os.sched_getscheduler(evaluator_process.process.pid) == os.SCHED_IDLE
    assert evaluator_process.process.wait(timeout=120) == 0, (tmp_path / "eval.log").read_text()[-3000:]
    assert requests.pending() == 0
    summary = monitor.finish(config, run_dir, "finished", time.time())

    lines, _ = monitor.read_metrics(run_dir / "metrics.jsonl")
    evals = [line for line in lines if line["source"] == "eval"]
    assert [(line["version"], line["step"]) for line in evals] == [(0, 0), (2, 2), (8, 8)]
    for line in evals:
        assert line["n"] == len(EVAL_ROWS) and line["k"] == 3
        assert 0 <= line["pass_at_1"] <= line["pass_at_k"] <= 1 and 0 <= line["maj_at_k"] <= 1
        assert 0 <= line["heldout_accuracy"] <= 1 and line["length_p50"] <= line["length_p90"] <= 4
        rows = (run_dir / "eval" / f"v{line['version']:06d}.jsonl").read_text().splitlines()
        assert len(rows) == len(EVAL_ROWS)
    assert summary["base_accuracy"] == evals[0]["heldout_accuracy"]
    assert summary["final_accuracy"] == evals[-1]["heldout_accuracy"]
    assert summary["eval_k"] == 3 and summary["final_pass_at_k"] == evals[-1]["pass_at_k"]
    assert summary["base_maj_at_k"] == evals[0]["maj_at_k"]
    assert json.loads((run_dir / "summary.json").read_text())["final_pass_at_1"] == evals[-1]["pass_at_1"]
    assert (run_dir / "curves.png").stat().st_size > 10_000
