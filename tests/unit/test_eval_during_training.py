"""Evaluation during training, without a broker: the run's evaluator scores weight versions as the monitor
does, each `eval` line tagged with its version, and the report (summary.json, curves.png) shows them."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from pipeline import monitor
from pipeline.config import load_config, resolve
from pipeline.evaluate import NO_EVAL_SET, Evaluator, rows_for_config
from workers import runtime
from workers.weights import unique_state_dict, write_version

EVAL_ROWS = [(12, 3), (40, 5), (99, 9), (10, 0), (55, 4)]


def own_jsonl_config(demo_model_dir: Path, tmp_path: Path, *overrides: str):
    """A run on rows of its own (reward math) with a held-out JSONL of its own."""
    rows = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) for a, b in EVAL_ROWS]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(rows) + "\n")
    return resolve(
        load_config(
            None,
            [
                "name=run",
                f"runs_dir={tmp_path}",
                f"model.path={demo_model_dir}",
                f"data.source={tmp_path / 'train.jsonl'}",
                f"data.eval_source={tmp_path / 'eval.jsonl'}",
                "data.reward=math",
                "rollout.max_new_tokens=4",
                "eval.every=2",
                *overrides,
            ],
        )
    )


def trainer_line(writer: runtime.MetricsWriter, step: int) -> None:
    writer.write(step=step, reward_mean=0.1 * step, staleness_mean=1.0, staleness_max=2, tokens_per_s=100.0)


def test_versions_are_scored_tagged_and_plotted(demo_model_dir: Path, tmp_path: Path) -> None:
    config = own_jsonl_config(demo_model_dir, tmp_path, "eval.k=3")
    run_dir = runtime.run_dir(config)
    run_dir.mkdir()
    evaluator = Evaluator.for_config(config)
    assert evaluator.score(evaluator.rows[0], "15.0") == (1.0, "15", "")  # the run's reward: math, not exact text
    base = monitor.evaluate_version(config, run_dir, evaluator, 0)  # what the launcher does before the workers
    weights = unique_state_dict(evaluator.model)
    trainer = runtime.MetricsWriter(run_dir / "metrics.jsonl", "trainer")
    for step in (1, 2, 3, 4):
        weights = {name: tensor * 1.01 for name, tensor in weights.items()}  # a new version each step
        write_version(weights, runtime.weights_dir(config), step, keep=4)
        trainer_line(trainer, step)
    assert monitor.evaluate_version(config, run_dir, evaluator, 2)["version"] == 2  # as follow() does at eval.every
    assert monitor.evaluate_version(config, run_dir, evaluator, 9) is None  # a version no longer kept
    summary = monitor.finish(config, run_dir, evaluator, base["heldout_accuracy"], "finished", time.time())

    lines, _ = monitor.read_metrics(run_dir / "metrics.jsonl")
    evals = [line for line in lines if line["source"] == "eval"]
    assert [(line["version"], line["step"]) for line in evals] == [(0, 0), (2, 2), (4, 4)]
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


def test_greedy_only_summary_has_no_sampled_numbers(demo_model_dir: Path, tmp_path: Path) -> None:
    config = resolve(load_config(None, ["name=run", f"runs_dir={tmp_path}", f"model.path={demo_model_dir}",
                                        "eval.max_rows=6", "rollout.max_new_tokens=4"]))  # fmt: skip
    run_dir = runtime.run_dir(config)
    run_dir.mkdir()
    evaluator = Evaluator.for_config(config)  # the task's own rows: its held-out split
    assert len(evaluator.rows) == 6
    base = monitor.evaluate_version(config, run_dir, evaluator, 0)
    assert set(base) == {"step", "version", "heldout_accuracy", "n", "k", "length_p50", "length_p90"}
    summary = monitor.finish(config, run_dir, evaluator, base["heldout_accuracy"], "finished", time.time())
    assert summary["base_accuracy"] == base["heldout_accuracy"] and summary["final_accuracy"] is None  # no step
    assert "eval_k" not in summary and "final_pass_at_1" not in summary


def test_a_dataset_file_without_eval_source_has_no_evaluation(demo_model_dir: Path, tmp_path: Path) -> None:
    config = own_jsonl_config(demo_model_dir, tmp_path, "data.eval_source=")
    assert rows_for_config(config) is None and Evaluator.for_config(config) is None
    assert "data.eval_source=" in NO_EVAL_SET


def test_evaluation_scores_every_row_with_the_run_s_threads(demo_model_dir: Path, tmp_path: Path) -> None:
    """Every row is scored without an error, math-verify's included (it times itself with SIGALRM, so it must
    run in the main thread: an evaluation moved to another thread scored every row 0 with a ValueError), and
    with a rollout worker's torch threads."""
    import torch

    config = own_jsonl_config(demo_model_dir, tmp_path)
    run_dir = runtime.run_dir(config)
    run_dir.mkdir()
    evaluator = Evaluator.for_config(config)
    torch.set_num_threads(2)
    assert monitor.evaluate_version(config, run_dir, evaluator, 0)["version"] == 0
    rows = [json.loads(line) for line in (run_dir / "eval" / "v000000.jsonl").read_text().splitlines()]
    assert len(rows) == len(EVAL_ROWS) and [row["errors"] for row in rows] == [[]] * len(EVAL_ROWS)
    assert torch.get_num_threads() == config.rollout.threads


def test_a_reported_version_s_file_is_waited_for_only_while_it_can_still_come(tmp_path: Path) -> None:
    coming, gone = tmp_path / "v000003.safetensors", tmp_path / "v000001.safetensors"
    threading.Timer(0.3, coming.write_bytes, [b"weights"]).start()  # the trainer writes it after its step line
    assert monitor.written(coming, timeout_s=10)
    assert not monitor.written(gone, timeout_s=10)  # a newer version is there: this one was deleted
    started = time.monotonic()
    assert not monitor.written(tmp_path / "v000004.safetensors", timeout_s=0)  # the trainer has stopped
    assert time.monotonic() - started < 0.5
