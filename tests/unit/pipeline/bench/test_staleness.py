"""`asyncrl bench staleness`: the grid, the rows and cells built from run results, the table and the plot.

The runs themselves are faked (summary.json and metrics.jsonl contents); everything
built from them is the real code.
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.bench import staleness, task_config
from pipeline.bench.staleness import Setting
from pipeline.cli import build_parser, main
from pipeline.config import ConfigError


def args_for(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "staleness", *argv])


def test_task_defaults_to_chain():
    assert args_for().task == "chain" and args_for("--task", "arith").task == "arith"


def test_quick_grid_is_eta_0_and_4_both_objectives_one_seed_half_the_steps():
    plan = staleness.plan_for(args_for("--quick"), task_steps=1200)
    assert plan.steps == 600
    assert staleness.grid(plan) == [
        Setting(0, "naive", 0),
        Setting(0, "decoupled", 0),
        Setting(4, "naive", 0),
        Setting(4, "decoupled", 0),
    ]


def test_full_grid_is_every_eta_and_objective_for_3_seeds_seed_major():
    plan = staleness.plan_for(args_for(), task_steps=1200)
    runs = staleness.grid(plan)
    assert plan.steps == 1200 and plan.seeds == (0, 1, 2) and len(runs) == 5 * 2 * 3
    assert {(s.eta, s.objective, s.seed) for s in runs} == {
        (eta, objective, seed) for eta in (0, 1, 2, 4, 8) for objective in ("naive", "decoupled") for seed in (0, 1, 2)
    }
    assert [s.seed for s in runs] == sorted(s.seed for s in runs)  # one seed's model serves its runs in a row


def test_steps_are_the_tasks_unless_given():
    assert staleness.plan_for(args_for(), task_steps=300).steps == 300
    assert staleness.plan_for(args_for("--quick"), task_steps=301).steps == 150
    plan = staleness.plan_for(args_for("--quick", "--seeds", "3", "5", "3", "--steps", "40"), task_steps=300)
    assert plan.seeds == (3, 5) and plan.steps == 40 and len(staleness.grid(plan)) == 8


def test_each_run_config_is_the_tasks_with_its_eta_objective_and_seed():
    plan = staleness.plan_for(args_for("--quick"), task_steps=1200)
    configs = staleness.run_configs(plan, "arith", ["trainer.steps=600", "trainer.optim.lr=3e-4", "runs_dir=/tmp/x"])
    config = configs[Setting(4, "naive", 0)]
    assert (config.trainer.max_staleness, config.trainer.loss.objective, config.seed) == (4, "naive", 0)
    assert config.data.task == "arith" and config.trainer.steps == 600
    assert config.trainer.batch_groups == 8 and config.trainer.optim.lr == 3e-4  # arith.yaml's, then the overrides
    assert len({c.name for c in configs.values()}) == 4


def test_prepare_defaults_to_the_chain_config_and_its_steps(tmp_path):
    prepared = staleness.prepare(args_for("--out", str(tmp_path / "s.json"), "trainer.optim.lr=3e-4"))
    chain = task_config("chain", [])
    assert chain.data.task == "chain"  # pipeline/configs/chain.yaml
    assert prepared.plan.steps == chain.trainer.steps and len(prepared.configs) == 30
    assert {(c.data.task, c.trainer.steps, c.trainer.optim.lr) for c in prepared.configs.values()} == {
        ("chain", chain.trainer.steps, 3e-4)
    }
    assert prepared.shared.runs_dir == str(tmp_path / "staleness-runs")


def test_prepare_for_arith_quick():
    prepared = staleness.prepare(args_for("--task", "arith", "--quick", "--eval-every", "20"))
    assert prepared.out == Path("runs/bench/staleness-arith-quick.json")  # nothing is written by prepare
    assert prepared.plan.steps == 300 and len(prepared.configs) == 4  # half arith.yaml's 600
    assert {(c.data.task, c.trainer.steps, c.eval.every) for c in prepared.configs.values()} == {("arith", 300, 20)}
    with pytest.raises(ConfigError, match="positive"):
        staleness.prepare(args_for("--task", "arith", "--steps", "0"))


def test_one_model_per_seed_built_for_the_task_as_asyncrl_run_builds_it(tmp_path, monkeypatch):
    import pipeline.demo_model

    calls = []

    def fake_prepare(out_dir, task, **kwargs):
        calls.append((Path(out_dir).name, task, kwargs))
        return out_dir

    monkeypatch.setattr(pipeline.demo_model, "prepare_demo_model", fake_prepare)
    plan = staleness.plan_for(args_for("--quick", "--seeds", "0", "7"), task_steps=1200)
    configs = staleness.run_configs(plan, "arith", ["runs_dir=/tmp/x"])
    models = staleness.build_models(configs, tmp_path, progress=False)
    assert models == {0: str(tmp_path / "seed0"), 7: str(tmp_path / "seed7")}
    expected = {
        "task_seed": 0,
        "steps": 150,
        "progress": False,
        "held_out": 200,
        "workflow": None,
    }  # 150: arith's warm-up cap, resolved
    assert calls == [
        ("seed0", "arith", {"seed": 0, **expected}),
        ("seed7", "arith", {"seed": 7, **expected, "task_seed": 7}),
    ]


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
    assert naive4["seeds"] == [0, 1] and naive4["final_accuracy"] == pytest.approx(0.32)
    assert naive4["final_accuracy_sd"] == 0.0283  # sqrt(((0.30 - 0.32)^2 + (0.34 - 0.32)^2) / (2 - 1))
    assert naive4["per_seed"]["final_accuracy"] == [0.3, 0.34]
    assert naive4["max_staleness_trained"] == 4 and naive4["wall_seconds"] == 70.0 and naive4["wall_seconds_sd"] == 0


def test_mean_and_sample_sd():
    assert staleness.mean_sd([0.5, 0.6, 0.7]) == (0.6, 0.1)
    assert staleness.mean_sd([0, 0, 3]) == (1.0, 1.7321)  # sqrt((1 + 1 + 4) / 2)
    assert staleness.mean_sd([0.42]) == (0.42, None)


def row(eta: int, objective: str, seed: int, final: float, **values) -> dict:
    """A row as `measure` makes it, with round numbers."""
    numbers = {"tail_accuracy": final - 0.1, "best_accuracy": final + 0.1, "staleness_mean": float(eta)}
    numbers |= {"clip_fraction_mean": 0.01, "steps_per_s": 2.0, "wall_seconds": 70.0, "groups_dropped": 0}
    numbers |= {"max_staleness_trained": eta, "curve": [[0, 0.15], [50, final - 0.05], [100, final]]}
    return {"eta": eta, "objective": objective, "seed": seed, "final_accuracy": final, **numbers, **values}


def three_seeds() -> list[dict]:
    """naive at eta 4 over seeds 2, 0, 1 (out of order); decoupled at eta 4 over seeds 0 and 1."""
    return [
        row(4, "naive", 2, 0.7, clip_fraction_mean=0.03, steps_per_s=3.0, wall_seconds=80.0, groups_dropped=3),
        row(4, "naive", 0, 0.5, clip_fraction_mean=0.01, steps_per_s=1.0, wall_seconds=60.0),
        row(4, "naive", 1, 0.6, clip_fraction_mean=0.02, steps_per_s=2.0, max_staleness_trained=3),
        row(4, "decoupled", 0, 0.8),
        row(4, "decoupled", 1, 0.7),
    ]


def test_a_cell_is_the_mean_and_sample_sd_of_every_number_over_its_seeds():
    naive, decoupled = staleness.cells(three_seeds())
    assert naive["seeds"] == [0, 1, 2] and decoupled["seeds"] == [0, 1]
    assert {key: (naive[key], naive[f"{key}_sd"]) for key in staleness.SPREAD_KEYS} == {
        "final_accuracy": (0.6, 0.1),
        "tail_accuracy": (0.5, 0.1),
        "best_accuracy": (0.7, 0.1),
        "staleness_mean": (4.0, 0.0),
        "clip_fraction_mean": (0.02, 0.01),
        "steps_per_s": (2.0, 1.0),
        "wall_seconds": (70.0, 10.0),
        "groups_dropped": (1.0, 1.7321),
    }
    assert naive["max_staleness_trained"] == 4  # the worst seed, not a mean
    assert naive["per_seed"]["final_accuracy"] == [0.5, 0.6, 0.7]  # in the order of "seeds"
    assert naive["per_seed"]["groups_dropped"] == [0, 0, 3]
    assert (decoupled["final_accuracy"], decoupled["final_accuracy_sd"]) == (0.75, 0.0707)


def test_the_table_prints_mean_and_sd_per_cell_and_the_gap_paired_by_seed():
    lines = staleness.table(report_of(three_seeds())).splitlines()
    assert lines[0] == (
        "chain: held-out greedy accuracy (%) after 100 steps, mean ± sample sd over seeds [0, 1]; "
        "tail = mean of the last 3 evaluations (every 25 steps)"
    )
    assert lines[1] == (
        "objective  eta seeds        final         tail         best stale max   clipped %     dropped     wall s"
    )
    assert lines[2] == (
        "naive        4     3  60.0 ± 10.0  50.0 ± 10.0  70.0 ± 10.0         4   2.0 ± 1.0   1.0 ± 1.7    70 ± 10"
    )
    assert lines[3] == (
        "decoupled    4     2   75.0 ± 7.1   65.0 ± 7.1   85.0 ± 7.1         4   1.0 ± 0.0   0.0 ± 0.0     70 ± 0"
    )
    # seed 0: 0.8 - 0.5, seed 1: 0.7 - 0.6 -> mean 0.2, sd 0.1414 (seed 2 has no decoupled run to pair with)
    assert lines[4] == "eta 4: decoupled - naive = +20.0 ± 14.1 final, +20.0 ± 14.1 tail (points, paired by seed)"
    assert lines[5] == "5 runs in 10.0 min (models 20 s)"


def report_of(rows: list[dict]) -> dict:
    return {
        "cells": staleness.cells(rows),
        "rows": rows,
        "wall_seconds": 600.0,
        "models_seconds": 20.0,
        "settings": {
            "task": "chain",
            "steps": 100,
            "seeds": [0, 1],
            "tail_evals": staleness.TAIL_EVALS,
            "eval_every": 25,
        },
    }


def test_table_shows_every_cell_and_the_gap_between_the_objectives():
    text = staleness.table(report_of(fake_rows()))
    assert "\nnaive        4     2   32.0 ± 2.8 " in text
    assert "eta 4: decoupled - naive = +21.0 ± 1.4 final" in text  # per seed: +20, +22 points
    assert "eta 0: decoupled - naive = -1.0 ± 4.2 final" in text  # per seed: +2, -4 points
    assert "8 runs in 10.0 min" in text


def test_one_seed_has_no_spread():
    rows = [r for r in fake_rows() if r["seed"] == 0]
    assert all(c[f"{key}_sd"] is None for c in staleness.cells(rows) for key in staleness.SPREAD_KEYS)
    text = staleness.table(report_of(rows))
    assert "\nnaive        0     1     50.0 ± -" in text and "eta 0: decoupled - naive = +2.0 ± - final" in text


@pytest.mark.parametrize("seeds", [(0, 1), (0,)])
def test_the_plot_is_a_png(tmp_path, seeds):
    path = tmp_path / "staleness.png"
    staleness.plot(report_of([r for r in fake_rows() if r["seed"] in seeds]), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_reports_of_separate_seeds_merge_into_the_same_table_and_plot(tmp_path, capsys):
    rows = fake_rows()
    paths = []
    for seed in (0, 1):  # one report per seed, as two invocations (or machines) would write them
        report = {**report_of([r for r in rows if r["seed"] == seed]), "machine": {"cpu_count": 2}}
        report |= {"wall_seconds": 300.0, "models_seconds": 10.0}
        report["settings"] = {**report["settings"], "seeds": [seed]}
        paths.append(tmp_path / f"seed{seed}.json")
        paths[-1].write_text(json.dumps(report))
    out = tmp_path / "merged.json"
    assert main(["bench", "staleness", "--merge", *map(str, paths), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["settings"]["seeds"] == [0, 1] and len(merged["rows"]) == 8
    assert merged["cells"] == staleness.cells(rows)  # as if one invocation had run both seeds
    assert out.with_suffix(".png").exists()
    assert staleness.table(report_of(rows)) in capsys.readouterr().out  # the same table, line for line

    assert main(["bench", "staleness", "--merge", str(paths[0]), str(paths[0]), "--out", str(out)]) == 2
    for key, value in (("steps", 200), ("task", "arith")):
        other = json.loads(paths[1].read_text())
        other["settings"][key] = value
        paths[1].write_text(json.dumps(other))
        assert main(["bench", "staleness", "--merge", *map(str, paths), "--out", str(out)]) == 2
        assert f"differ in {key}" in capsys.readouterr().err
        other["settings"][key] = {"steps": 100, "task": "chain"}[key]
        paths[1].write_text(json.dumps(other))


def test_etas_pick_part_of_the_grid():
    plan = staleness.plan_for(args_for("--seeds", "1", "--etas", "4", "8", "4"), task_steps=100)
    assert staleness.grid(plan) == [Setting(eta, o, 1) for eta in (4, 8) for o in ("naive", "decoupled")]


def test_the_grid_hands_on_its_rows_after_every_run_and_stops_at_one_that_did_not_finish(tmp_path, monkeypatch):
    """The report is saved as it grows, so a grid stopped part way keeps the runs it finished."""
    summary = {"final_accuracy": 0.5, "base_accuracy": 0.2, "wall_seconds": 60.0, "steps": 2,
               "max_staleness_trained": 1, "groups_dropped": 0, "interrupted_trajectories": 3}  # fmt: skip
    lines = [
        {"source": "trainer", "step": s, "time": float(s), "staleness_mean": 0.5, "clip_fraction": 0.0} for s in (1, 2)
    ] + [{"source": "eval", "step": 2, "heldout_accuracy": 0.5}]
    finished = {"naive", "decoupled"}

    def fake_run(config, progress):
        if config.trainer.max_staleness == 8:
            return None
        run_dir = tmp_path / config.name
        run_dir.mkdir()
        (run_dir / "summary.json").write_text(json.dumps(summary))
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return run_dir

    monkeypatch.setattr(staleness, "run_to_end", fake_run)
    plan = staleness.plan_for(args_for("--seeds", "1", "--etas", "4", "8"), task_steps=2)
    configs = staleness.run_configs(plan, "arith", [f"runs_dir={tmp_path}"])
    saved: list[int] = []
    rows, failed = staleness.run_grid(configs, progress=False, on_row=lambda rows: saved.append(len(rows)))
    assert saved == [1, 2] and failed == Setting(8, "naive", 1)
    assert {r["objective"] for r in rows} == finished and all(r["eta"] == 4 for r in rows)


def test_large_grid_is_eta_up_to_32_every_variant_3_seeds():
    plan = staleness.plan_for(args_for("--large"), task_steps=200)
    runs = staleness.grid(plan)
    assert plan.etas == (0, 4, 8, 16, 32) and plan.seeds == (0, 1, 2) and len(runs) == 5 * 4 * 3
    assert runs[:4] == [Setting(0, v, 0) for v in ("naive", "decoupled", "icepop", "m2po")]
    assert staleness.prepare(args_for("--large")).out.name == "staleness-chain-large.json"
    with pytest.raises(SystemExit):
        args_for("--large", "--quick")


def test_variants_pick_the_objectives_in_their_order_and_set_each_ones_loss():
    plan = staleness.plan_for(args_for("--variants", "m2po", "naive", "--etas", "32", "--seeds", "0"), 100)
    assert staleness.grid(plan) == [Setting(32, "naive", 0), Setting(32, "m2po", 0)]
    common = ["trainer.loss.behaviour_weight_cap=3", "runs_dir=/tmp/x"]  # a cap for the grid: not IcePop's or M2PO's
    configs = staleness.run_configs(replace(plan, variants=tuple(staleness.VARIANTS)), "chain", common)
    losses = {s.objective: c.trainer.loss for s, c in configs.items()}
    assert {
        v: (loss.objective, loss.behaviour_weight_mode, loss.behaviour_weight_cap) for v, loss in losses.items()
    } == {
        "naive": ("naive", "cap", 3.0),
        "decoupled": ("decoupled", "cap", 3.0),
        "icepop": ("decoupled", "icepop", 0.0),
        "m2po": ("m2po", "cap", 0.0),
    }


def test_every_variant_has_its_gap_to_naive_its_masked_share_and_its_panel(tmp_path):
    rows = fake_rows()
    for objective, final, masked in (("icepop", [0.6, 0.62], 0.01), ("m2po", [0.4, 0.44], 0.002)):
        for seed in (0, 1):
            summary, lines = fake_run(Setting(4, objective, seed), final[seed])
            lines = [{**l, f"{objective}_masked": masked} if l["source"] == "trainer" else l for l in lines]
            rows.append(staleness.measure(Setting(4, objective, seed), summary, lines))
    assert {r["objective"]: r["masked_fraction_mean"] for r in rows if r["eta"] == 4} == {
        "naive": 0.0,
        "decoupled": 0.0,
        "icepop": 0.01,
        "m2po": 0.002,
    }
    text = staleness.table(report_of(rows))
    assert "eta 4: icepop - naive = +29.0 ± 1.4 final" in text  # per seed: +30, +28 points
    assert "eta 4: m2po - naive = +10.0 ± 0.0 final" in text
    assert [line.split()[0] for line in text.splitlines()[2:8]] == [
        "naive",
        "naive",
        "decoupled",
        "decoupled",
        "icepop",
        "m2po",
    ]
    staleness.plot(report_of(rows), tmp_path / "four.png")
    assert (tmp_path / "four.png").stat().st_size > 10_000


def test_four_variants_plot_in_two_rows_with_the_finals_beside_them():
    assert staleness.panel_layout(["naive", "decoupled"]) == [["naive", "decoupled", "finals"]]
    assert staleness.panel_layout(["naive", "decoupled", "icepop", "m2po"]) == [
        ["naive", "decoupled", "finals"],
        ["icepop", "m2po", "finals"],
    ]
    assert staleness.panel_layout(["naive", "decoupled", "icepop"]) == [
        ["naive", "decoupled", "finals"],
        ["icepop", ".", "finals"],
    ]
    assert staleness.panel_size(["naive", "decoupled", "icepop", "m2po"]) == (17.1, 9.6)
