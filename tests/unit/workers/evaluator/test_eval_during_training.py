"""Evaluation during training, without a broker: the versions the monitor asks for are queued, the run's
evaluator process scores them, each `eval` line tagged with its version, and the report (summary.json,
curves.png) shows them."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from pipeline import monitor
from pipeline.config import load_config, resolve, save_config
from pipeline.eval_set import NO_EVAL_SET, rows_for_config
from pipeline.eval_worker import EvalRequests, link, queue_dir, queued, score_version
from pipeline.evaluate import Evaluator
from pipeline.launch import WorkerProcess
from workers import runtime
from workers.runtime import version_path
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
    assert evaluator.score(evaluator.rows[0], "15.0") == (1.0, "15", "")  # the run's reward: math, not exact text
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


def test_greedy_only_summary_has_no_sampled_numbers(demo_model_dir: Path, tmp_path: Path) -> None:
    config = resolve(load_config(None, ["name=run", f"runs_dir={tmp_path}", f"model.path={demo_model_dir}",
                                        "eval.max_rows=6", "rollout.max_new_tokens=4"]))  # fmt: skip
    run_dir = runtime.run_dir(config)
    run_dir.mkdir()
    evaluator = Evaluator.for_config(config)  # the task's own rows: its held-out split
    assert len(evaluator.rows) == 6
    base = score_version(run_dir, evaluator, 0, None)
    assert set(base) == {"step", "version", "heldout_accuracy", "n", "k", "length_p50", "length_p90"}
    summary = monitor.finish(config, run_dir, "finished", time.time())
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
    assert score_version(run_dir, evaluator, 0, None)["version"] == 0
    rows = [json.loads(line) for line in (run_dir / "eval" / "v000000.jsonl").read_text().splitlines()]
    assert len(rows) == len(EVAL_ROWS) and [row["errors"] for row in rows] == [[]] * len(EVAL_ROWS)
    assert torch.get_num_threads() == config.rollout.threads


def test_a_version_is_queued_once_written_and_given_up_only_when_it_cannot_come(tmp_path: Path) -> None:
    weights, run_dir = tmp_path / "weights", tmp_path / "run"
    weights.mkdir()
    requests = EvalRequests(run_dir, weights)
    requests.ask(3)  # reported by the trainer, its file not written yet: asked for, no waiting
    assert requests.pending() == 1 and not list(queue_dir(run_dir).iterdir())
    (weights / "v000003.safetensors").write_bytes(b"weights")  # the trainer writes it after its step line
    assert requests.link_written() == [] and (queue_dir(run_dir) / "v000003.safetensors").read_bytes() == b"weights"
    requests.ask(1)  # a newer version is there: this one was deleted (the run keeps only its newest)
    requests.ask(5, wait_s=0)  # not written in time (the trainer has stopped)
    requests.ask(7)
    assert requests.link_written() == [] and requests.pending() == 2  # v3 queued, v7 still on its way
    requests.close()  # the trainer has stopped: v7 will never come
    assert requests.pending() == 1 and (queue_dir(run_dir) / "done").exists()
    assert [request.name for request in queued(queue_dir(run_dir))] == ["v000003.safetensors"]


def test_a_resumed_run_s_queue_loses_the_versions_it_trains_anew(tmp_path: Path) -> None:
    """The killed launch asked for versions past the checkpoint the run resumes from: their links hold weights the
    resumed run never announces, and would take the place of the versions it writes under the same numbers."""
    weights, run_dir = tmp_path / "weights", tmp_path / "run"
    queue = queue_dir(run_dir)
    queue.mkdir(parents=True)
    for name in ("v000000.base", "v000004.safetensors", "v000005.safetensors", "v000007.safetensors"):
        (queue / name).write_bytes(b"weights")
    EvalRequests(run_dir, weights, resumed_from=5)
    assert [request.name for request in queued(queue)] == ["v000000.base", "v000004.safetensors", "v000005.safetensors"]
    EvalRequests(run_dir, weights)  # not resumed: the queue as it is
    assert len(queued(queue)) == 3


def test_weights_on_another_file_system_are_copied_into_the_queue(tmp_path: Path, monkeypatch) -> None:
    source, target = tmp_path / "v000002.safetensors", tmp_path / "queue" / "v000002.safetensors"
    source.write_bytes(b"weights")
    target.parent.mkdir()

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    link(source, target)
    assert target.read_bytes() == b"weights" and not list(target.parent.glob("*.partial"))
    with pytest.raises(FileNotFoundError):
        link(tmp_path / "v000009.safetensors", target.with_name("v000009.safetensors"))


def test_a_version_that_cannot_be_scored_is_dropped_with_its_reason_and_the_next_one_scored(
    demo_model_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The evaluator's loop in this process (this test's threads keep their priority)."""
    import asyncio

    from pipeline import eval_worker

    monkeypatch.setattr(eval_worker, "lower_priority", lambda: None)
    config = own_jsonl_config(demo_model_dir, tmp_path)
    run_dir = runtime.run_dir(config)
    queue = queue_dir(run_dir)
    queue.mkdir(parents=True)
    (queue / "v000001.safetensors").write_bytes(b"not safetensors")
    good = Evaluator.for_config(config).model
    write_version(unique_state_dict(good), tmp_path / "weights", 2, keep=4)
    link(tmp_path / "weights" / "v000002.safetensors", queue / "v000002.safetensors")
    (queue / "done").touch()
    asyncio.run(eval_worker.main(config, asyncio.Event()))  # returns: the queue is scored and nothing more comes
    assert "asyncrl eval: version 1 not scored: SafetensorError" in capsys.readouterr().out
    lines, _ = monitor.read_metrics(run_dir / "metrics.jsonl")
    assert [line["version"] for line in lines if line["source"] == "eval"] == [2]
    assert queued(queue) == []
