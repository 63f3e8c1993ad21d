"""`asyncrl bench staleness`: held-out accuracy against the staleness bound, naive vs corrected objectives.

The paper's Table 2 / Figure 5 on a task's own rows: `--task`'s shipped config
(pipeline/configs/<task>.yaml, default `chain`, whose long-tailed chains give staleness
more to act on than arith's 3-token answers) trained with eta in {0, 1, 2, 4, 8} under
both objectives, each run a whole `asyncrl run` of the task's trainer.steps. Naive PPO
clips the ratio against the behaviour policy, which lags the trainer by up to eta
versions; decoupled PPO clips against pi_prox (the weights when the batch arrives) and
corrects for the behaviour policy with an importance weight, so it should keep its
accuracy as eta grows where naive PPO loses some. `--variants` adds decoupled PPO with
IcePop's band on that weight and M2PO (`VARIANTS`); `--large` is the large-staleness grid,
eta up to 32, all four.

The warm-up model is built once per seed, exactly as `asyncrl run` builds it for
that seed, and shared by every run of the seed: they all start from the same weights
and differ only in eta and the objective (and in what asynchrony decides). Seeds
differ in weights, held-out split, data order and sampling. Accuracy is greedy on the
held-out problems every `--eval-every` steps; `tail` is the mean of the last
TAIL_EVALS evaluations, less noisy than the final one alone. Each cell (objective, eta)
is the mean +- sample sd over the seeds of every number the table shows (the per-seed
values are in the JSON beside them), and the gap between the objectives is paired by seed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import transformers
from tqdm import tqdm

from pipeline.bench import (
    build_demo_model,
    cores_given,
    machine,
    run_to_end,
    task_config,
    task_label,
    with_model,
)
from pipeline.config import ConfigError
from pipeline.monitor import read_metrics
from schemas.config import RunConfig

# Each variant's trainer.loss, after the overrides common to the grid (IcePop and M2PO have no cap).
VARIANTS = {
    "naive": ["trainer.loss.objective=naive"],
    "decoupled": ["trainer.loss.objective=decoupled"],
    "icepop": [
        "trainer.loss.objective=decoupled",
        "trainer.loss.behaviour_weight_mode=icepop",
        "trainer.loss.behaviour_weight_cap=0",
    ],
    "m2po": ["trainer.loss.objective=m2po", "trainer.loss.behaviour_weight_cap=0"],
}
TITLES = {
    "naive": "naive PPO (π_prox = π_behav)",
    "decoupled": "decoupled PPO (π_prox recomputed)",
    "icepop": "decoupled PPO + IcePop",
    "m2po": "M2PO",
}
OBJECTIVES = ("naive", "decoupled")  # the default grid's variants
TAIL_EVALS = 3
PLOT_ETAS = (0, 1, 2, 4, 8, 16, 32)  # the colour scale, fixed so that an eta has one colour in every plot
# The tokens each variant's loss drops or caps, as the trainer's metrics name them.
MASKED_STATS = ("behaviour_weight_over_cap", "icepop_masked", "m2po_masked")


# Averaged over seeds per cell, each with its sample sd: every number of the table but the worst staleness.
SPREAD_KEYS = (
    "final_accuracy",
    "tail_accuracy",
    "best_accuracy",
    "staleness_mean",
    "clip_fraction_mean",
    "steps_per_s",
    "wall_seconds",
    "groups_dropped",
)


@dataclass(frozen=True)
class Plan:
    etas: tuple[int, ...]
    seeds: tuple[int, ...]
    steps: int  # 0 in the presets: the task's trainer.steps (QUICK: half), see plan_for
    variants: tuple[str, ...] = OBJECTIVES


# arith: 1,200 steps is the demo's length (~16 % -> 51-61 % at eta 4); 600 already reaches ~50 %.
FULL = Plan(etas=(0, 1, 2, 4, 8), seeds=(0, 1, 2), steps=0)
QUICK = Plan(etas=(0, 4), seeds=(0,), steps=0)  # arith: 4 runs of 600 steps, 21 min on 2 cores shared with other work
LARGE = Plan(etas=(0, 4, 8, 16, 32), seeds=(0, 1, 2), steps=0, variants=tuple(VARIANTS))  # 60 runs


@dataclass(frozen=True)
class Setting:
    """One run of the grid."""

    eta: int
    objective: str
    seed: int

    def overrides(self) -> list[str]:
        return [
            f"trainer.max_staleness={self.eta}",
            *VARIANTS[self.objective],
            f"seed={self.seed}",
            f"name=staleness-{self.objective}-eta{self.eta}-seed{self.seed}",
        ]


def plan_for(args: argparse.Namespace, task_steps: int) -> Plan:
    """The grid of `args`; steps: `--steps`, else the task config's `task_steps` (`--quick`: half of them)."""
    base = LARGE if args.large else QUICK if args.quick else FULL
    default_steps = max(1, task_steps // 2) if args.quick else task_steps
    return replace(
        base,
        seeds=tuple(dict.fromkeys(args.seeds or base.seeds)),
        etas=tuple(dict.fromkeys(args.etas or base.etas)),
        steps=default_steps if args.steps is None else args.steps,
        variants=tuple(v for v in VARIANTS if v in (args.variants or base.variants)),
    )


def grid(plan: Plan) -> list[Setting]:
    """Seed-major, so one seed's model serves its runs in a row;
    the objectives alternate so load elsewhere hits both alike."""
    return [Setting(eta, variant, seed) for seed in plan.seeds for eta in plan.etas for variant in plan.variants]


def run_configs(plan: Plan, task: str, common: list[str]) -> dict[Setting, RunConfig]:
    """Every run's config (the task's shipped one, `common`, the run's own), all validated before anything starts."""
    return {s: task_config(task, [*common, *s.overrides()]) for s in grid(plan)}


def build_models(configs: dict[Setting, RunConfig], models_dir: Path, progress: bool) -> dict[int, str]:
    """The task's demo model once per seed, with the arguments pipeline.launch.run_dir.prepare would give it
    (none if model.path is set)."""
    built: dict[int, str] = {}
    for config in configs.values():
        if not config.model.path and config.seed not in built:
            built[config.seed] = build_demo_model(config, models_dir / f"seed{config.seed}", progress)
    return built


def measure(setting: Setting, summary: dict, lines: list[dict]) -> dict:
    """One row of the JSON: what a run reached, from its summary.json and metrics.jsonl lines."""
    curve = sorted({l["step"]: l["heldout_accuracy"] for l in lines if l["source"] == "eval"}.items())
    trainer = [l for l in lines if l["source"] == "trainer"]
    accuracies = [accuracy for _, accuracy in curve]
    return {
        "eta": setting.eta,
        "objective": setting.objective,
        "seed": setting.seed,
        "final_accuracy": summary["final_accuracy"],
        "best_accuracy": max(accuracies),
        "tail_accuracy": round(statistics.fmean(accuracies[-TAIL_EVALS:]), 4),
        "base_accuracy": summary["base_accuracy"],
        "wall_seconds": summary["wall_seconds"],
        "steps": summary["steps"],
        "steps_per_s": round((len(trainer) - 1) / (trainer[-1]["time"] - trainer[0]["time"]), 3),
        "max_staleness_trained": summary["max_staleness_trained"],
        "staleness_mean": round(statistics.fmean(l["staleness_mean"] for l in trainer), 3),
        "clip_fraction_mean": round(statistics.fmean(l["clip_fraction"] for l in trainer), 4),
        "masked_fraction_mean": round(statistics.fmean(masked_fraction(l) for l in trainer), 4),
        "groups_dropped": summary["groups_dropped"],
        "interrupted_trajectories": summary["interrupted_trajectories"],
        "curve": [list(point) for point in curve],
    }


def masked_fraction(line: dict) -> float:
    """The share of a step's trained tokens its loss dropped or capped (behaviour-weight cap or mask, IcePop, M2PO)."""
    return sum(line.get(key, 0.0) for key in MASKED_STATS)


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample sd (n - 1), 4 decimals; no sd from one value."""
    sd = round(statistics.stdev(values), 4) if len(values) > 1 else None
    return round(statistics.fmean(values), 4), sd


def cell(objective: str, eta: int, group: list[dict]) -> dict:
    """One objective and eta over its seeds: mean and sd of each SPREAD_KEYS number, the per-seed values, the worst
    staleness."""
    group = sorted(group, key=lambda r: r["seed"])
    out: dict = {"objective": objective, "eta": eta, "seeds": [r["seed"] for r in group]}
    for key in SPREAD_KEYS:
        out[key], out[f"{key}_sd"] = mean_sd([r[key] for r in group])
    out["max_staleness_trained"] = max(r["max_staleness_trained"] for r in group)
    out["per_seed"] = {key: [r[key] for r in group] for key in SPREAD_KEYS}  # in the order of "seeds"
    return out


def cells(rows: list[dict]) -> list[dict]:
    """Per objective and eta (naive first, eta ascending): `cell` over the seeds that ran it."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["objective"], row["eta"]].append(row)
    order = sorted(groups, key=lambda key: (list(VARIANTS).index(key[0]), key[1]))
    return [cell(objective, eta, groups[objective, eta]) for objective, eta in order]


def pm(mean: float, sd: float | None, scale: float = 100.0, digits: int = 1, sign: bool = False) -> str:
    """'mean ± sd' (scaled: 100 for points of accuracy); '-' for the sd of one seed."""
    spread = "-" if sd is None else f"{sd * scale:.{digits}f}"
    return f"{mean * scale:{'+' if sign else ''}.{digits}f} ± {spread}"


def paired_gap(naive: dict, decoupled: dict, key: str) -> tuple[float, float | None]:
    """decoupled - naive of `key`, seed by seed (the two share each seed's model): mean and sd over common seeds."""
    a = dict(zip(naive["seeds"], naive["per_seed"][key], strict=True))
    b = dict(zip(decoupled["seeds"], decoupled["per_seed"][key], strict=True))
    return mean_sd([b[seed] - a[seed] for seed in sorted(a.keys() & b.keys())])


def cell_line(c: dict) -> str:
    return (
        f"{c['objective']:<10} {c['eta']:>3} {len(c['seeds']):>5} "
        f"{pm(c['final_accuracy'], c['final_accuracy_sd']):>12} {pm(c['tail_accuracy'], c['tail_accuracy_sd']):>12} "
        f"{pm(c['best_accuracy'], c['best_accuracy_sd']):>12} {c['max_staleness_trained']:>9} "
        f"{pm(c['clip_fraction_mean'], c['clip_fraction_mean_sd']):>11} "
        f"{pm(c['groups_dropped'], c['groups_dropped_sd'], 1):>11} "
        f"{pm(c['wall_seconds'], c['wall_seconds_sd'], 1, 0):>10}"
    )


def table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"{s.get('task', 'arith')}: held-out greedy accuracy (%) after {s['steps']} steps, mean ± sample sd over "
        f"seeds {s['seeds']}; tail = mean of the last {s['tail_evals']} evaluations (every {s['eval_every']} steps)",
        f"{'objective':<10} {'eta':>3} {'seeds':>5} {'final':>12} {'tail':>12} {'best':>12} "
        f"{'stale max':>9} {'clipped %':>11} {'dropped':>11} {'wall s':>10}",
        *(cell_line(c) for c in report["cells"]),
    ]
    lines += gap_lines(report["cells"])
    lines.append(
        f"{len(report['rows'])} runs in {report['wall_seconds'] / 60:.1f} min (models {report['models_seconds']:.0f} s)"
    )
    return "\n".join(lines)


def gap_lines(cell_list: list[dict]) -> list[str]:
    """Per eta, each variant's accuracy minus naive PPO's, paired by seed (where both ran a seed)."""
    by_key = {(c["objective"], c["eta"]): c for c in cell_list}
    lines = []
    for eta in sorted({c["eta"] for c in cell_list}):
        naive = by_key.get(("naive", eta))
        for variant in [v for v in VARIANTS if v != "naive"]:
            other = by_key.get((variant, eta))
            if naive and other and set(naive["seeds"]) & set(other["seeds"]):
                final, tail = (
                    pm(*paired_gap(naive, other, key), sign=True) for key in ("final_accuracy", "tail_accuracy")
                )
                lines.append(f"eta {eta}: {variant} - naive = {final} final, {tail} tail (points, paired by seed)")
    return lines


def mean_curve(rows: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """Accuracy per evaluated step: mean and sample sd (0 from one run) over the runs that evaluated it."""
    at: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        for step, accuracy in row["curve"]:
            at[step].append(accuracy)
    steps = sorted(at)
    spread = [statistics.stdev(at[step]) if len(at[step]) > 1 else 0.0 for step in steps]
    return steps, [statistics.fmean(at[step]) for step in steps], spread


def plot_curves(ax, rows: list[dict], objective: str, colour_of) -> None:
    """One objective's held-out accuracy vs trainer step: per eta the mean over seeds, its ± sd as a band."""
    for eta in sorted({r["eta"] for r in rows}):
        runs = [r for r in rows if r["objective"] == objective and r["eta"] == eta]
        if not runs:
            continue
        steps, means, sds = mean_curve(runs)
        ax.plot(steps, means, color=colour_of(eta), linewidth=2, marker="o", markersize=3, label=f"η = {eta}")
        if len(runs) > 1:
            low, high = (
                [m - d for m, d in zip(means, sds, strict=True)],
                [m + d for m, d in zip(means, sds, strict=True)],
            )
            ax.fill_between(steps, low, high, color=colour_of(eta), alpha=0.12, linewidth=0)
    ax.set_title(TITLES[objective])
    ax.set_xlabel("trainer step")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def plot_finals(ax, cell_list: list[dict]) -> None:
    """Final held-out accuracy vs eta per variant, error bars ± sd over seeds (the paper's Table 2 as a figure)."""
    variants = [v for v in VARIANTS if any(c["objective"] == v for c in cell_list)]
    for index, objective in enumerate(variants):
        shift = (index - (len(variants) - 1) / 2) * 0.08
        mine = [c for c in cell_list if c["objective"] == objective]
        ax.errorbar(
            [c["eta"] + shift for c in mine],
            [c["final_accuracy"] for c in mine],
            yerr=[c["final_accuracy_sd"] or 0.0 for c in mine],
            marker="o",
            capsize=4,
            linewidth=1.5,
            label=TITLES[objective],
        )
    ax.set_xticks(sorted({c["eta"] for c in cell_list}))
    ax.set_title("final accuracy, mean ± sd over seeds")
    ax.set_xlabel("staleness bound η")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")


def panel_layout(variants: list[str]) -> list[list[str]]:
    """One panel per variant and the finals beside them: one row for up to two variants, else two rows of
    curves with the finals spanning both (four variants in one row would be 28 inches wide)."""
    if len(variants) <= 2:
        return [[*variants, "finals"]]
    width = -(-len(variants) // 2)
    top, bottom = variants[:width], variants[width:]
    return [[*top, "finals"], [*bottom, *["."] * (width - len(bottom)), "finals"]]


def panel_size(variants: list[str]) -> tuple[float, float]:
    layout = panel_layout(variants)
    return 5.7 * len(layout[0]), 4.8 * len(layout)


def plot(report: dict, path: Path) -> None:
    """Accuracy vs trainer step, one panel per variant, one colour per eta (mean ± sd band over seeds);
    then the final accuracy vs eta for every variant with ± sd error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    etas = sorted({*PLOT_ETAS, *(r["eta"] for r in rows)})
    colours = plt.get_cmap("viridis")
    variants = [v for v in VARIANTS if any(r["objective"] == v for r in rows)]
    fig, panels = plt.subplot_mosaic(panel_layout(variants), figsize=panel_size(variants), sharey=True)
    for objective in variants:
        plot_curves(
            panels[objective], rows, objective, lambda eta: colours(etas.index(eta) / max(len(etas) - 1, 1) * 0.9)
        )
    plot_finals(panels["finals"], report["cells"])
    for row in panel_layout(variants):
        panels[row[0]].set_ylabel("held-out greedy accuracy")
    panels["finals"].yaxis.set_tick_params(labelleft=True)
    tops = [c["final_accuracy"] + (c["final_accuracy_sd"] or 0.0) for c in report["cells"]]
    highest = max(0.1, *tops, *(a for r in rows for _, a in r["curve"]))
    panels["finals"].set_ylim(0, min(1.0, highest + 0.05))  # shared by every panel
    s = report["settings"]
    fig.suptitle(
        f"{s.get('task', 'arith')}: held-out accuracy vs staleness bound η, mean ± sd over {len(s['seeds'])} seed(s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_grid(
    configs: dict[Setting, RunConfig], progress: bool, on_row: Callable[[list[dict]], None]
) -> tuple[list[dict], Setting | None]:
    """The rows of the runs that finished, in grid order, and the run that did not, if one did not;
    `on_row` gets the rows after each run (the report is saved as it grows: a stopped grid keeps its runs)."""
    rows = []
    bar = tqdm(configs.items(), desc="bench staleness", unit="run", file=sys.stderr, disable=not progress)
    for setting, config in bar:
        bar.set_description(f"{setting.objective} eta={setting.eta} seed={setting.seed}")
        with contextlib.redirect_stdout(io.StringIO()):  # each run prints its summary.json; the table is our output
            run_dir = run_to_end(config, progress)
        if run_dir is None:
            bar.close()
            return rows, setting
        lines, _ = read_metrics(run_dir / "metrics.jsonl")
        rows.append(
            {**measure(setting, json.loads((run_dir / "summary.json").read_text()), lines), "run_dir": str(run_dir)}
        )
        on_row(rows)
    return rows, None


def merge(reports: list[dict]) -> dict:
    """One report from several of the same settings run separately (seeds on other machines or days)."""
    first = reports[0]["settings"]
    for report in reports[1:]:
        differ = [k for k in ("task", "steps", "eval_every", "tail_evals") if report["settings"].get(k) != first.get(k)]
        if differ:
            raise ValueError(f"the reports differ in {', '.join(differ)}: their rows cannot share a table")
    keys = [(r["eta"], r["objective"], r["seed"]) for report in reports for r in report["rows"]]
    if len(set(keys)) < len(keys):
        raise ValueError("the reports repeat a run (same eta, objective and seed)")
    rows = [row for report in reports for row in report["rows"]]
    return {
        "cells": cells(rows),
        "rows": rows,
        "wall_seconds": round(sum(r["wall_seconds"] for r in reports), 1),
        "models_seconds": round(sum(r["models_seconds"] for r in reports), 1),
        "settings": {**first, "seeds": sorted({r["seed"] for r in rows}), "etas": sorted({r["eta"] for r in rows})},
        "machine": reports[0]["machine"],
        "merged_from": len(reports),
    }


def save_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def write(report: dict, out: Path) -> None:
    """The report, and its table and plot once it has rows."""
    save_report(report, out)
    if report["rows"]:
        print(table(report))
        plot(report, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')}")


def run_merge(args: argparse.Namespace) -> int:
    """`--merge`: one report from the given ones, and its table and plot, without running anything."""
    try:
        report = merge([json.loads(Path(path).read_text()) for path in args.merge])
    except (OSError, ValueError, KeyError) as exc:
        print(f"asyncrl: cannot merge: {exc}", file=sys.stderr)
        return 2
    settings = report["settings"]
    label = task_label(settings.get("task_config") or settings.get("task", "arith"))
    write(report, Path(args.out or f"runs/bench/staleness-{label}.json"))
    return 0


@dataclass(frozen=True)
class Prepared:
    """What a grid needs before anything runs: the plan, every run's config and the settings they share."""

    plan: Plan
    out: Path
    common: list[str]
    shared: RunConfig  # every run's config before its own eta, objective and seed
    configs: dict[Setting, RunConfig]


def prepare(args: argparse.Namespace) -> Prepared:
    """The task's shipped config with `args`: the plan (steps from the task's config unless --steps), all configs."""
    plan = plan_for(args, task_config(args.task, args.overrides).trainer.steps)
    if plan.steps < 1 or args.eval_every < 1:
        raise ConfigError("--steps and --eval-every must be positive")
    preset = "-large" if args.large else "-quick" if args.quick else ""
    out = Path(args.out or f"runs/bench/staleness-{task_label(args.task)}{preset}.json")
    common = [
        *args.overrides,
        f"runs_dir={out.parent / 'staleness-runs'}",
        f"trainer.steps={plan.steps}",
        f"eval.every={args.eval_every}",
        "telemetry.sample_ratio=0",
    ]
    shared = task_config(args.task, common)
    if shared.data.source != "builtin":
        raise ConfigError(
            "bench staleness measures held-out accuracy on a task's own rows: data.source must be builtin"
        )
    return Prepared(plan, out, common, shared, run_configs(plan, args.task, common))


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return run_merge(args)
    started = time.time()
    # saving and loading bars would break the bars over runs and steps
    transformers.utils.logging.disable_progress_bar()
    p = prepare(args)
    print(
        f"bench staleness on {p.shared.data.task}: {len(p.configs)} runs of {p.plan.steps} steps "
        f"(eta {list(p.plan.etas)} x {list(p.plan.variants)} x seeds {list(p.plan.seeds)})",
        flush=True,
    )
    models_dir = Path(p.shared.runs_dir) / f"models-{time.strftime('%Y%m%d-%H%M%S')}"
    models = build_models(p.configs, models_dir, not args.no_progress)
    models_seconds = time.time() - started
    configs = {s: with_model(c, models[s.seed]) if s.seed in models else c for s, c in p.configs.items()}
    info = machine()

    def report_of(rows: list[dict]) -> dict:
        return {
            "cells": cells(rows),
            "rows": rows,
            "wall_seconds": round(time.time() - started, 1),
            "models_seconds": round(models_seconds, 1),
            "settings": settings_of(args, p, models, info),
            "machine": info,
        }

    def save(rows: list[dict]) -> None:
        save_report(report_of(rows), p.out)

    rows, failed = run_grid(configs, not args.no_progress, on_row=save)
    write(report_of(rows), p.out)
    if failed:
        print(f"asyncrl: the run {failed} did not finish; {p.out} has the {len(rows)} runs before it", file=sys.stderr)
        return 1
    return 0


def settings_of(args: argparse.Namespace, p: Prepared, models: dict[int, str], info: dict) -> dict:
    """What every run of the grid shared, as the report records it."""
    return {
        "task": p.shared.data.task,
        "task_config": args.task,
        "quick": args.quick,
        "large": args.large,
        "etas": list(p.plan.etas),
        "objectives": list(p.plan.variants),
        "seeds": list(p.plan.seeds),
        "steps": p.plan.steps,
        "eval_every": args.eval_every,
        "tail_evals": TAIL_EVALS,
        "overrides": p.common,
        "models": models,
        "model": "the task's demo model, warmed up once per seed, shared by every run of that seed",
        "cores_given": cores_given(p.shared, info["cpu_count"], info["usable_cores"]),
        "config": msgspec.to_builtins(p.shared),
    }
