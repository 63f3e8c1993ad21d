"""`asyncrl eval` end to end on a tiny local model (built here, nothing downloaded): an own JSONL, a Parquet
file, a task's held-out split, a run's weight versions, and the one-line errors for what cannot be used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from pipeline.config import load_config, resolve, save_config
from schemas.messages import WeightVersion, encode
from workers.weights import unique_state_dict, write_version

HEADLINE = ("pass_at_1", "pass_at_k", "maj_at_k", "greedy_accuracy", "k", "n")
ROWS = [(12, 3), (40, 5), (99, 9), (10, 0), (55, 4), (71, 8)]
REWARDS = '''
def has_five(prompt, completion, metadata):
    """Right when a 5 appears: a random model gets it sometimes, so every metric moves."""
    if metadata.get("explode") == "true":
        raise RuntimeError("verifier broke on purpose")
    return 1.0 if "5" in completion else 0.0
'''


@pytest.fixture
def rows_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "eval_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps({"prompt": f"{a}+{b}=", "answer": a + b, "explode": i == 2}) for i, (a, b) in enumerate(ROWS)]
    path.write_text("\n".join([*lines, "{not json"]) + "\n")
    return path


def run_eval(*args: str) -> int:
    return main(["eval", "--no-progress", "--max-new-tokens", "6", *args])


def check_summary(summary: dict, n: int, k: int) -> None:
    assert list(summary)[: len(HEADLINE)] == list(HEADLINE)
    assert summary["n"] == n and summary["k"] == k
    for key in ("pass_at_1", "pass_at_k", "maj_at_k", "greedy_accuracy"):
        assert 0.0 <= summary[key] <= 1.0, key
    assert summary["pass_at_k"] >= summary["pass_at_1"]
    assert 1 <= summary["length_p50"] <= summary["length_p90"] <= 6


def test_eval_on_an_own_jsonl(demo_model_dir: Path, rows_file: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out" / "eval.json"
    assert run_eval("--model", str(demo_model_dir), "--data", str(rows_file), "--k", "4", "--reward",
                    "eval_rewards:has_five", "--out", str(out)) == 0  # fmt: skip
    summary = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == summary  # printed too
    check_summary(summary, n=len(ROWS), k=4)  # the bad line is skipped, with a note on stderr
    assert summary["task"] is None and summary["data"] == str(rows_file)  # an own file: no task named
    rows = [json.loads(line) for line in (tmp_path / "out" / "eval.rows.jsonl").read_text().splitlines()]
    assert len(rows) == summary["n"] and all(len(r["sample_scores"]) == 4 for r in rows)
    # the summary is exactly the per-row results aggregated (n = k, so pass@k is "any right sample")
    assert summary["pass_at_1"] == pytest.approx(sum(r["correct"] / 4 for r in rows) / len(rows))
    assert summary["pass_at_k"] == pytest.approx(sum(r["correct"] > 0 for r in rows) / len(rows))
    assert summary["maj_at_k"] == pytest.approx(sum(r["majority_score"] == 1.0 for r in rows) / len(rows))
    assert summary["greedy_accuracy"] == pytest.approx(sum(r["greedy_score"] for r in rows) / len(rows))
    for r in rows:
        assert r["correct"] == sum(("5" in c) for c in r["sample_completions"]) or r["errors"]
        assert r["majority_answer"] in r["sample_answers"]
    exploded = rows[2]  # the verifier raised: scored 0, the error kept, the command went on
    assert exploded["greedy_score"] == 0.0 and exploded["correct"] == 0
    assert len(exploded["errors"]) == 5 and "RuntimeError: verifier broke on purpose" in exploded["errors"][0]
    assert summary["errors"] == 5


def test_eval_on_parquet_with_math_and_greedy_only(demo_model_dir: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": [f"{a}+{b}=" for a, b in ROWS], "answer": [a + b for a, b in ROWS]}), data)
    out = tmp_path / "parquet.json"
    assert run_eval("--model", str(demo_model_dir), "--data", str(data), "--out", str(out)) == 0
    summary = json.loads(out.read_text())
    assert summary["reward"] == "math" and summary["n"] == len(ROWS) and summary["k"] == 0
    assert summary["pass_at_1"] is summary["pass_at_k"] is summary["maj_at_k"] is None
    assert 0.0 <= summary["greedy_accuracy"] <= 1.0


def test_eval_on_a_tasks_held_out_split(demo_model_dir: Path, tmp_path: Path) -> None:
    out, rows_out = tmp_path / "task.json", tmp_path / "per-row.jsonl"
    args = ("--model", str(demo_model_dir), "--task", "arith", "--max-rows", "12", "--k", "3", "--temperature", "0.8")
    assert run_eval(*args, "--out", str(out), "--rows-out", str(rows_out)) == 0
    summary = json.loads(out.read_text())
    check_summary(summary, n=12, k=3)
    assert summary["reward"] == "builtin" and summary["task"] == "arith" and summary["temperature"] == 0.8
    assert "held-out split (seed 0, 200 problems)" in summary["data"]
    rows = [json.loads(line) for line in rows_out.read_text().splitlines()]
    assert len(rows) == 12
    from workers.tasks import load_task

    _, held_out = load_task("arith").split(0, 200)
    assert [r["prompt"] for r in rows] == [p.prompt for p in held_out[:12]]


def test_eval_stops_at_a_stop_string_and_counts_truncated_completions(demo_model_dir: Path, tmp_path: Path) -> None:
    """Each completion ends with the first token that completes a --stop string (kept), else at the end token or
    the output budget; `truncated` counts those cut at the budget."""
    out = tmp_path / "stop.json"
    args = ("--model", str(demo_model_dir), "--task", "arith", "--max-rows", "12", "--k", "2", "--stop", "1")
    assert run_eval(*args, "--stop", "+", "--out", str(out)) == 0
    summary = json.loads(out.read_text())
    rows = [json.loads(line) for line in (tmp_path / "stop.rows.jsonl").read_text().splitlines()]
    completions = [c for r in rows for c in (r["greedy_completion"], *r["sample_completions"])]
    lengths = [n for r in rows for n in (r["greedy_length"], *r["sample_lengths"])]
    assert summary["stop"] == ["1", "+"] and any("1" in c for c in completions)
    for text in completions:
        cut = min((text.index(s) + 1 for s in ("1", "+") if s in text), default=len(text))
        assert text[:cut] == text  # nothing after the first stop string (one character, one token here)
    budget = sum(n == 6 and not any(s in c for s in ("1", "+")) for c, n in zip(completions, lengths, strict=True))
    assert 0 < summary["truncated"] == sum(r["truncated"] for r in rows) <= budget  # at 6 tokens, not stopped


def make_run(demo_model_dir: Path, tmp_path: Path, versions: list[int]) -> Path:
    """A run directory as `asyncrl run` leaves it: config.yaml, weights/v<N>.safetensors."""
    config = resolve(load_config(None, ["name=r1", f"runs_dir={tmp_path}", f"model.path={demo_model_dir}"]))
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    save_config(config, run_dir / "config.yaml")
    from workers.models import load_causal_lm

    model = load_causal_lm(str(demo_model_dir))
    for version in versions:
        with torch.no_grad():
            model.lm_head.weight.mul_(1.01)  # tied to the embedding: each version differs a little
        write_version(unique_state_dict(model), run_dir / "weights", version, keep=8)
    return run_dir


def write_export(run_dir: Path, version: int, content_hash: str) -> None:
    """A topics export holding one `weights` announcement (what the embedded broker's run leaves)."""
    from topics.export import ExportedRecord, ExportedTopic, ExportEnd, ExportHeader, _write_frame

    announced = WeightVersion(version=version, uri="", content_hash=content_hash, step=version,
                              groups_consumed=0, groups_dropped=0)  # fmt: skip
    record = ExportedRecord(role="weights", partition=0, offset=0, timestamp=0, key=None, value=encode(announced),
                            headers=[])  # fmt: skip
    with open(run_dir / "topics.export", "wb") as out:
        _write_frame(out, ExportHeader(prefix="", topics=[ExportedTopic(role="weights", name="weights", partitions=1)]))
        _write_frame(out, record)
        _write_frame(out, ExportEnd(records=1))


def test_eval_of_a_runs_weight_versions(demo_model_dir: Path, tmp_path: Path, capsys) -> None:
    run_dir = make_run(demo_model_dir, tmp_path, [2, 4])
    args = ("--run", str(run_dir), "--max-rows", "4")
    assert run_eval(*args) == 0  # latest, on the run's task's held-out split
    latest = json.loads(capsys.readouterr().out)
    assert latest["version"] == 4 and latest["n"] == 4 and latest["reward"] == "builtin"
    assert run_eval(*args, "--version", "0") == 0  # the base model
    assert json.loads(capsys.readouterr().out)["version"] == 0

    from workers.weights import file_hash

    write_export(run_dir, 2, file_hash(run_dir / "weights" / "v000002.safetensors"))
    assert run_eval(*args, "--version", "2") == 0  # the announced hash matches
    write_export(run_dir, 2, "0" * 64)
    assert run_eval(*args, "--version", "2") == 1
    assert "has sha256" in capsys.readouterr().err

    torn = run_dir / "weights" / "v000004.safetensors"
    torn.write_bytes(torn.read_bytes()[:1000])  # a torn copy, no export to compare with
    assert run_eval(*args, "--version", "4") == 1
    err = capsys.readouterr().err
    assert err.startswith("asyncrl: weights v4:") and "truncated" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "MODEL", "--data", "missing.jsonl"], "asyncrl: --data missing.jsonl: No such file"),
        (["--model", "MODEL"], "asyncrl: give --data FILE"),
        (["--model", "nowhere", "--task", "arith"], "asyncrl: --model nowhere: not a Hugging Face model directory"),
        (["--run", "nowhere"], "asyncrl: --run nowhere: no config.yaml there"),
        (["--run", "RUN", "--version", "7"], "asyncrl: --version 7: no v000007.safetensors"),
        (["--model", "MODEL", "--task", "nosuch"], "asyncrl: --task nosuch:"),
        (["--model", "MODEL", "--task", "arith", "--reward", "nosuch_module:f"], "asyncrl: reward 'nosuch_module:f'"),
    ],
)
def test_unusable_input_is_one_line_not_a_traceback(
    demo_model_dir: Path, tmp_path: Path, capsys, args: list[str], message: str
) -> None:
    run_dir = make_run(demo_model_dir, tmp_path, [1]) if "RUN" in args else None
    args = [str(demo_model_dir) if a == "MODEL" else str(run_dir) if a == "RUN" else a for a in args]
    capsys.readouterr()  # what building the run printed
    assert run_eval(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
