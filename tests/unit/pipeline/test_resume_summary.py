"""The report of a resumed run, from metrics.jsonl alone: steps lost with a killed broker and trained again
count once (their new lines stand), evaluations of the abandoned versions are gone, the resume is listed, and the
base accuracy is the first launch's."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline import monitor
from pipeline.config import load_config, resolve


def trainer(step: int, length: int) -> dict:
    return {"source": "trainer", "step": step, "completion_lengths": [length], "trained_trajectories": 4 * step}


def test_a_step_trained_again_replaces_its_line_and_those_after() -> None:
    lines = [trainer(1, 1), trainer(2, 2), trainer(3, 3), {"source": "eval", "step": 2}, trainer(2, 20)]
    lines += [trainer(3, 30), trainer(4, 40), trainer(4, 41), trainer(5, 50)]
    assert [(l["step"], l["completion_lengths"]) for l in monitor.standing_steps(lines)] == [
        (1, [1]), (2, [20]), (3, [30]), (4, [41]), (5, [50])
    ]  # fmt: skip
    assert monitor.standing_steps([]) == []


def evaluation(version: int, accuracy: float) -> dict:
    return {"source": "eval", "step": version, "version": version, "heldout_accuracy": accuracy}


def test_a_resume_drops_the_evaluations_of_the_versions_it_abandons() -> None:
    first = [{"source": "start", "step": 0}, evaluation(0, 0.1), *(trainer(step, step) for step in range(1, 6))]
    first += [evaluation(2, 0.2), evaluation(4, 0.4), evaluation(5, 0.5), {"source": "rollout", "step": 5}]
    again = [{"source": "resume", "step": 3}, trainer(4, 40), evaluation(4, 0.44)]
    standing = monitor.standing_lines(first + again)
    assert [(l["source"], l["step"], l.get("heldout_accuracy")) for l in standing] == [
        ("start", 0, None), ("eval", 0, 0.1), ("trainer", 1, None), ("trainer", 2, None), ("trainer", 3, None),
        ("eval", 2, 0.2), ("rollout", 5, None), ("resume", 3, None), ("trainer", 4, None), ("eval", 4, 0.44),
    ]  # fmt: skip
    assert standing[-2]["completion_lengths"] == [40]
    assert monitor.standing_lines(first) == first  # nothing resumed: every line stands
    not_yet = monitor.standing_lines(first + again[:1])  # the resumed run has not trained step 4 again yet
    assert [(l["source"], l["step"]) for l in not_yet if l["source"] in ("trainer", "eval")] == [
        ("eval", 0), ("trainer", 1), ("trainer", 2), ("trainer", 3), ("eval", 2)
    ]  # fmt: skip


def test_a_resumed_run_s_summary_counts_each_step_once(tmp_path: Path) -> None:
    config = resolve(load_config(None, ["name=run", f"runs_dir={tmp_path}", "trainer.steps=5"]))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    first = [evaluation(0, 0.25)]
    first += [trainer(step, 99 if step > 3 else step) for step in range(1, 6)]  # 4, 5: lost with the broker
    first.append(evaluation(5, 0.9))  # of weights the resumed run abandons
    metrics.write_text("".join(json.dumps({"time": 1.0, **line}) + "\n" for line in first))
    size = metrics.stat().st_size
    offset = monitor.note_start(run_dir, resumed_from=3)
    assert offset == metrics.stat().st_size > size and monitor.read_metrics(metrics, size)[0][0]["step"] == 3
    with open(metrics, "a") as out:
        for step in (4, 5):
            out.write(json.dumps({"time": 2.0, **trainer(step, step)}) + "\n")
    summary = monitor.finish(config, run_dir, "finished", started=0.0)
    assert (summary["steps"], summary["trained_trajectories"], summary["resumed_from"]) == (5, 20, [3])
    assert (summary["completion_len_max"], summary["base_accuracy"]) == (5, 0.25)
    assert summary["final_accuracy"] is None  # the resumed run's version 5 was not evaluated
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] == [3]


def test_the_summary_names_what_ran_and_the_shares_truncated_and_interrupted(tmp_path: Path) -> None:
    rows = tmp_path / "mine.jsonl"
    config = resolve(
        load_config(
            None,
            ["name=own", f"runs_dir={tmp_path}", f"model.path={tmp_path}/m", f"data.source={rows}", "data.reward=math"],
        )
    )
    run_dir = tmp_path / "own"
    run_dir.mkdir()
    last = trainer(2, 7) | {"truncated_trajectories": 2, "interrupted_trajectories": 6}  # of 8 trained
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"time": 1.0, **l}) + "\n" for l in (trainer(1, 5), last))
    )
    summary = monitor.finish(config, run_dir, "finished", started=0.0)
    assert (summary["model"], summary["data"], summary["eval_data"]) == (f"{tmp_path}/m", str(rows), "none")
    assert (summary["reward"], summary["template"]) == ("math", "raw") and "task" not in summary
    assert (summary["truncated_trajectories"], summary["truncated_share"], summary["interrupted_share"]) == (
        2,
        0.25,
        0.75,
    )
    demo = monitor.what_ran(resolve(load_config(None, ["data.task=chain"])))
    assert (demo["data"], demo["reward"]) == ("task chain", "task chain: its verifier")
    assert demo["eval_data"] == "task chain: held-out split (200 problems)"
