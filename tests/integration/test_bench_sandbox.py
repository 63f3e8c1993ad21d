"""`asyncrl bench sandbox` end to end with a handful of executions (no timing asserted)."""

import json

import pytest

from pipeline.bench.sandbox import PROGRAMS
from pipeline.cli import main
from workers.sandbox.bwrap import run_python


@pytest.fixture
def sandbox(request: pytest.FixtureRequest) -> str:
    """bwrap from the session's `bubblewrap` fixture (tests/conftest.py); a skip where it cannot run the sandbox."""
    try:
        return request.getfixturevalue("bubblewrap")
    except pytest.fail.Exception as exc:
        pytest.skip(f"no working bwrap here: {exc}")


def test_the_checker_it_times_does_its_work(sandbox):
    program, stdin = PROGRAMS["checker"]
    done = run_python(program, stdin)
    assert done.status == "ok" and json.loads(done.stdout)["sum"] == "153/4"  # 3/4 + 12 + 51/4 + 51/4


def test_the_bench_counts_executions_per_second_and_writes_its_report(sandbox, tmp_path, capsys):
    out = tmp_path / "sandbox.json"
    assert main(["bench", "sandbox", "--executions", "3", "--parallelism", "1", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for mode in ("cold", "warm"):
        runs = [(row["program"], row["parallelism"], row["executions"]) for row in report[mode]]
        assert runs == [("pass", 1, 3), ("pass", 2, 3), ("checker", 1, 3), ("checker", 2, 3)]
        assert all(row["per_s"] > 0 and row["failures"] == 0 for row in report[mode])
    assert len(report["warm_over_cold"]) == 4 and report["python_alone"]["executions"] == 3
    assert "warm/cold" in capsys.readouterr().out
