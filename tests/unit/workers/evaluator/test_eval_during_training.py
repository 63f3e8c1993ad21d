"""Evaluation during training, without a broker: the versions the monitor asks for are queued and scored in
order, a version that cannot come is given up, and the summary says what was scored (the evaluator in a process of
its own: tests/integration)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import time
from pathlib import Path

import pytest

from pipeline import monitor
from pipeline.config import load_config, resolve
from workers import runtime
from workers.evaluator.rows import NO_EVAL_SET, rows_for_config
from workers.evaluator.scoring import Evaluator
from workers.evaluator.worker import EvalRequests, link, queue_dir, queued, score_version
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


def test_greedy_only_summary_has_no_sampled_numbers(demo_model_dir: Path, tmp_path: Path) -> None:
    config = resolve(load_config(None, ["name=run", f"runs_dir={tmp_path}", f"model.path={demo_model_dir}",
                                        "eval.max_rows=6", "rollout.max_new_tokens=4"]))  # fmt: skip
    run_dir = runtime.run_dir(config)
    run_dir.mkdir()
    evaluator = Evaluator.for_config(config)  # the task's own rows: its held-out split
    assert len(evaluator.rows) == 6
    base = asyncio.run(score_version(run_dir, evaluator, 0, None))
    assert set(base) == {"step", "version", "heldout_accuracy", "n", "k", "length_p50", "length_p90"} | {
        "reward_calls",
        "reward_failures",
        "seconds",
    }
    assert base["reward_calls"] == 6 and base["reward_failures"] == {}
    summary = monitor.finish(config, run_dir, "finished", time.time())
    assert summary["base_accuracy"] == base["heldout_accuracy"] and summary["final_accuracy"] is None  # no step
    assert summary["n"] == 6  # the held-out rows behind the accuracies
    assert "eval_k" not in summary and "final_pass_at_1" not in summary


def test_a_dataset_file_without_eval_source_has_no_evaluation(demo_model_dir: Path, tmp_path: Path) -> None:
    config = own_jsonl_config(demo_model_dir, tmp_path, "data.eval_source=auto")  # a file: nothing held out
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
    assert asyncio.run(score_version(run_dir, evaluator, 0, None))["version"] == 0
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


def test_a_delta_version_is_queued_as_its_whole_file_and_a_broken_chain_is_dropped(tmp_path: Path, capsys) -> None:
    from tests.unit.workers.test_weight_deltas import publish_all, versions
    from workers.weights import file_hash

    weights, run_dir = tmp_path / "weights", tmp_path / "run"
    published = publish_all(weights, versions(6), whole_every=3)
    requests = EvalRequests(run_dir, weights)
    requests.ask(5)  # a delta on the delta of v4, on whole v3
    assert file_hash(queue_dir(run_dir) / "v000005.safetensors") == published[5].sha256  # the whole file, as announced
    broken = runtime.delta_path(weights, 2)
    broken.write_bytes(broken.read_bytes()[:-3] + b"xyz")
    requests.ask(2)
    assert requests.pending() == 1 and not (queue_dir(run_dir) / "v000002.safetensors").exists()
    assert f"asyncrl eval: version 2 not queued: weights v2: delta {broken} is corrupt" in capsys.readouterr().out


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
    from workers.evaluator import worker as eval_worker

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
    failed = [line for line in lines if line["source"] == "eval_failed"]
    assert [line["version"] for line in failed] == [1] and "SafetensorError" in failed[0]["reason"]
    assert queued(queue) == []
