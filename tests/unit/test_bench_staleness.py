"""`asyncrl bench staleness`: the grid, the rows and cells built from run results, the table and the plot.

The runs themselves are faked (summary.json and metrics.jsonl contents); everything
built from them is the real code.
"""

import argparse

import pytest

from pipeline.bench import staleness
from pipeline.bench.staleness import Setting
from pipeline.cli import build_parser


def args_for(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "staleness", *argv])


def test_quick_grid_is_eta_0_and_4_both_objectives_one_seed():
    plan = staleness.plan_for(args_for("--quick"))
    assert plan.steps == 600
    assert staleness.grid(plan) == [
        Setting(0, "naive", 0),
        Setting(0, "decoupled", 0),
        Setting(4, "naive", 0),
        Setting(4, "decoupled", 0),
    ]


def test_full_grid_is_every_eta_and_objective_per_seed_seed_major():
    plan = staleness.plan_for(args_for())
    runs = staleness.grid(plan)
    assert plan.steps == 1200 and len(runs) == 5 * 2 * 3
    assert {(s.eta, s.objective, s.seed) for s in runs} == {
        (eta, objective, seed) for eta in (0, 1, 2, 4, 8) for objective in ("naive", "decoupled") for seed in (0, 1, 2)
    }
    assert [s.seed for s in runs] == sorted(s.seed for s in runs)  # one seed's model serves its runs in a row


def test_options_override_seeds_and_steps():
    plan = staleness.plan_for(args_for("--quick", "--seeds", "3", "5", "3", "--steps", "40"))
    assert plan.seeds == (3, 5) and plan.steps == 40 and len(staleness.grid(plan)) == 8


def test_each_run_config_sets_its_eta_objective_and_seed_over_the_demo():
    configs = staleness.run_configs(staleness.QUICK, ["trainer.steps=600", "trainer.optim.lr=3e-4", "runs_dir=/tmp/x"])
    config = configs[Setting(4, "naive", 0)]
    assert (config.trainer.max_staleness, config.trainer.loss.objective, config.seed) == (4, "naive", 0)
    assert config.trainer.batch_groups == 8 and config.trainer.optim.lr == 3e-4  # the demo's, then the common overrides
    assert len({c.name for c in configs.values()}) == 4


def fake_run(setting: Setting, final: float, steps: int = 100) -> tuple[dict, list[dict]]:
    """What run_pipeline leaves behind, reduced to the fields the bench reads."""
    evals = [
        {"source": "eval", "step": s, "heldout_accuracy": round(0.15 + (final - 0.15) * s / steps, 3)}
        for s in range(0, steps + 1, 25)
    ]
    trainer = [
        {
            "source": "trainer",
            "step": s,
            "time": 10.0 + s * 0.5,
            "staleness_mean": float(setting.eta),
            "clip_fraction": 0.01 * setting.eta * (setting.objective == "naive"),
        }
        for s in range(1, steps + 1)
    ]
    summary = {
        "final_accuracy": final,
        "base_accuracy": 0.15,
        "wall_seconds": 70.0,
        "steps": steps,
        "max_staleness_trained": setting.eta,
        "groups_dropped": 0,
        "interrupted_trajectories": 3,
    }
    return summary, [*trainer, *evals]


FINALS = {
    ("naive", 0): [0.5, 0.54],
    ("decoupled", 0): [0.52, 0.5],
    ("naive", 4): [0.3, 0.34],
    ("decoupled", 4): [0.5, 0.56],
}


def fake_rows() -> list[dict]:
    return [
        staleness.measure(Setting(eta, objective, seed), *fake_run(Setting(eta, objective, seed), finals[seed]))
        for (objective, eta), finals in FINALS.items()
        for seed in (0, 1)
    ]


def test_a_row_has_the_accuracies_curve_and_staleness_of_its_run():
    row = staleness.measure(Setting(4, "naive", 1), *fake_run(Setting(4, "naive", 1), 0.55))
    assert (row["eta"], row["objective"], row["seed"], row["final_accuracy"], row["wall_seconds"]) == (
        4,
        "naive",
        1,
        0.55,
        70.0,
    )
    assert row["curve"][0] == [0, 0.15] and row["curve"][-1] == [100, 0.55] and len(row["curve"]) == 5
    assert row["best_accuracy"] == 0.55
    assert row["tail_accuracy"] == pytest.approx((0.35 + 0.45 + 0.55) / 3)  # the last three evaluations
    assert row["steps_per_s"] == pytest.approx(2.0)
    assert (row["max_staleness_trained"], row["staleness_mean"], row["clip_fraction_mean"]) == (4, 4.0, 0.04)


def test_cells_average_over_seeds_per_objective_and_eta():
    cells = staleness.cells(fake_rows())
    assert [(c["objective"], c["eta"]) for c in cells] == [
        ("naive", 0),
        ("naive", 4),
        ("decoupled", 0),
        ("decoupled", 4),
    ]
    naive4 = cells[1]
    assert naive4["seeds"] == 2 and naive4["final_accuracy"] == pytest.approx(0.32)
    assert naive4["final_accuracy_sd"] == pytest.approx(0.0283, abs=1e-4)
    assert naive4["max_staleness_trained"] == 4 and naive4["wall_seconds"] == 70.0


def report_of(rows: list[dict]) -> dict:
    return {
        "cells": staleness.cells(rows),
        "rows": rows,
        "wall_seconds": 600.0,
        "models_seconds": 20.0,
        "settings": {"steps": 100, "seeds": [0, 1], "tail_evals": staleness.TAIL_EVALS, "eval_every": 25},
    }


def test_table_shows_every_cell_and_the_gap_between_the_objectives():
    text = staleness.table(report_of(fake_rows()))
    assert "naive        4     2  32.0%  2.8%" in text
    assert "eta 4: decoupled - naive = +21.0% final" in text
    assert "eta 0: decoupled - naive = -1.0% final" in text
    assert "8 runs in 10.0 min" in text


def test_one_seed_has_no_spread():
    rows = [r for r in fake_rows() if r["seed"] == 0]
    assert all(c["final_accuracy_sd"] is None for c in staleness.cells(rows))
    assert "50.0%     -" in staleness.table(report_of(rows))


def test_the_plot_is_a_png(tmp_path):
    path = tmp_path / "staleness.png"
    staleness.plot(report_of(fake_rows()), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_reports_of_separate_runs_merge_into_one_table_and_plot(tmp_path, capsys):
    import json

    from pipeline.cli import main

    rows = fake_rows()
    paths = []
    for seed in (0, 1):  # one report per seed, as two invocations (or machines) would write them
        report = {**report_of([r for r in rows if r["seed"] == seed]), "machine": {"cpu_count": 2}}
        report["settings"] = {**report["settings"], "seeds": [seed]}
        paths.append(tmp_path / f"seed{seed}.json")
        paths[-1].write_text(json.dumps(report))
    out = tmp_path / "merged.json"
    assert main(["bench", "staleness", "--merge", *map(str, paths), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["settings"]["seeds"] == [0, 1] and len(merged["rows"]) == 8
    assert merged["cells"] == staleness.cells(rows)  # as if one invocation had run both seeds
    assert out.with_suffix(".png").exists() and "naive        4     2  32.0%  2.8%" in capsys.readouterr().out

    assert main(["bench", "staleness", "--merge", str(paths[0]), str(paths[0]), "--out", str(out)]) == 2
    other = json.loads(paths[1].read_text())
    other["settings"]["steps"] = 200
    paths[1].write_text(json.dumps(other))
    assert main(["bench", "staleness", "--merge", *map(str, paths), "--out", str(out)]) == 2
    assert "differ in steps" in capsys.readouterr().err
