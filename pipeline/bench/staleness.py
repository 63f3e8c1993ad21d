"""`asyncrl bench staleness`: held-out accuracy against the staleness bound, naive vs decoupled PPO.

The paper's Table 2 / Figure 5 on the built-in task: the demo (configs/arith.yaml)
trained with eta in {0, 1, 2, 4, 8} under both objectives, each run a whole
`asyncrl run`. Naive PPO clips the ratio against the behaviour policy, which lags
the trainer by up to eta versions; decoupled PPO clips against pi_prox (the weights
when the batch arrives) and corrects for the behaviour policy with an importance
weight, so it should keep its accuracy as eta grows where naive PPO loses some.

The warm-up model is built once per seed, exactly as `asyncrl run` builds it for
that seed, and shared by every run of the seed: they all start from the same weights
and differ only in eta and the objective (and in what asynchrony decides). Seeds
differ in weights, held-out split, data order and sampling. Accuracy is greedy on the
held-out problems every `--eval-every` steps; `tail` is the mean of the last
TAIL_EVALS evaluations, less noisy than the final one alone.
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
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import transformers
from tqdm import tqdm

from pipeline.bench import machine, run_to_end
from pipeline.cli import config_file
from pipeline.config import ConfigError, load_config, resolve
from pipeline.monitor import read_metrics
from schemas.config import RunConfig

OBJECTIVES = ("naive", "decoupled")
TAIL_EVALS = 3
PLOT_ETAS = (0, 1, 2, 4, 8)  # the colour scale, fixed so that an eta has one colour in every plot


@dataclass(frozen=True)
class Plan:
    etas: tuple[int, ...]
    seeds: tuple[int, ...]
    steps: int


# 1,200 steps is the demo's length (~16 % -> 51-61 % at eta 4); 600 already reaches ~50 %.
FULL = Plan(etas=(0, 1, 2, 4, 8), seeds=(0, 1, 2), steps=1200)
QUICK = Plan(etas=(0, 4), seeds=(0,), steps=600)  # 4 runs: 21 min measured on 2 cores shared with other work


@dataclass(frozen=True)
class Setting:
    """One run of the grid."""

    eta: int
    objective: str
    seed: int

    def overrides(self) -> list[str]:
        return [
            f"trainer.max_staleness={self.eta}",
            f"trainer.loss.objective={self.objective}",
            f"seed={self.seed}",
            f"name=staleness-{self.objective}-eta{self.eta}-seed{self.seed}",
        ]


def plan_for(args: argparse.Namespace) -> Plan:
    base = QUICK if args.quick else FULL
    return replace(
        base,
        seeds=tuple(dict.fromkeys(args.seeds or base.seeds)),
        steps=base.steps if args.steps is None else args.steps,
    )


def grid(plan: Plan) -> list[Setting]:
    """Seed-major, so one seed's model serves its runs in a row;
    the objectives alternate so load elsewhere hits both alike."""
    return [Setting(eta, objective, seed) for seed in plan.seeds for eta in plan.etas for objective in OBJECTIVES]


def run_configs(plan: Plan, common: list[str]) -> dict[Setting, RunConfig]:
    """Every run's config, all validated before anything starts."""
    return {s: load_config(config_file(None), [*common, *s.overrides()]) for s in grid(plan)}


def build_models(configs: dict[Setting, RunConfig], models_dir: Path, progress: bool) -> dict[int, str]:
    """The demo model once per seed, with the arguments launch.prepare would give it (none if model.path is set)."""
    from pipeline.demo_model import prepare_demo_model

    built: dict[int, str] = {}
    for config in configs.values():
        if not config.model.path and config.seed not in built:
            built[config.seed] = str(
                prepare_demo_model(
                    models_dir / f"seed{config.seed}",
                    config.data.task,
                    seed=config.seed,
                    task_seed=config.seed,
                    steps=resolve(config).model.warmup_steps,
                    progress=progress,
                    held_out=config.data.held_out,
                )
            )
    return built


def with_model(config: RunConfig, path: str) -> RunConfig:
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=path))


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
        "groups_dropped": summary["groups_dropped"],
        "interrupted_trajectories": summary["interrupted_trajectories"],
        "curve": [list(point) for point in curve],
    }


def cells(rows: list[dict]) -> list[dict]:
    """Per objective and eta, over seeds: means, the spread of the final accuracy, the worst staleness."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["objective"], row["eta"]].append(row)
    out = []
    for (objective, eta), group in sorted(groups.items(), key=lambda item: (OBJECTIVES.index(item[0][0]), item[0][1])):
        finals = [r["final_accuracy"] for r in group]
        out.append(
            {
                "objective": objective,
                "eta": eta,
                "seeds": len(group),
                **{
                    key: round(statistics.fmean(r[key] for r in group), 4)
                    for key in (
                        "final_accuracy",
                        "tail_accuracy",
                        "best_accuracy",
                        "clip_fraction_mean",
                        "wall_seconds",
                    )
                },
                "final_accuracy_sd": round(statistics.stdev(finals), 4) if len(finals) > 1 else None,
                "max_staleness_trained": max(r["max_staleness_trained"] for r in group),
                "groups_dropped": sum(r["groups_dropped"] for r in group),
            }
        )
    return out


def table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"held-out greedy accuracy after {s['steps']} steps, mean over seeds {s['seeds']}; "
        f"tail = mean of the last {s['tail_evals']} evaluations (every {s['eval_every']} steps)",
        f"{'objective':<10} {'eta':>3} {'seeds':>5} {'final':>6} {'sd':>5} {'tail':>6} {'best':>6} "
        f"{'stale max':>9} {'clipped':>7} {'dropped':>7} {'wall s':>7}",
    ]
    for c in report["cells"]:
        sd = "-" if c["final_accuracy_sd"] is None else f"{c['final_accuracy_sd']:.1%}"
        lines.append(
            f"{c['objective']:<10} {c['eta']:>3} {c['seeds']:>5} {c['final_accuracy']:>6.1%} {sd:>5} "
            f"{c['tail_accuracy']:>6.1%} {c['best_accuracy']:>6.1%} {c['max_staleness_trained']:>9} "
            f"{c['clip_fraction_mean']:>7.1%} {c['groups_dropped']:>7} {c['wall_seconds']:>7.0f}"
        )
    by_key = {(c["objective"], c["eta"]): c for c in report["cells"]}
    for eta in sorted({c["eta"] for c in report["cells"]}):
        if ("naive", eta) in by_key and ("decoupled", eta) in by_key:
            naive, decoupled = by_key["naive", eta], by_key["decoupled", eta]
            lines.append(
                f"eta {eta}: decoupled - naive = {decoupled['final_accuracy'] - naive['final_accuracy']:+.1%} "
                f"final, {decoupled['tail_accuracy'] - naive['tail_accuracy']:+.1%} tail"
            )
    lines.append(
        f"{len(report['rows'])} runs in {report['wall_seconds'] / 60:.1f} min (models {report['models_seconds']:.0f} s)"
    )
    return "\n".join(lines)


def mean_curve(rows: list[dict]) -> tuple[list[int], list[float]]:
    """Accuracy per evaluated step, averaged over the runs that evaluated it."""
    at: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        for step, accuracy in row["curve"]:
            at[step].append(accuracy)
    steps = sorted(at)
    return steps, [statistics.fmean(at[step]) for step in steps]


def plot(report: dict, path: Path) -> None:
    """Held-out accuracy vs trainer step, one panel per objective, one colour per eta (seeds: thin; mean: bold)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    etas = sorted({*PLOT_ETAS, *(r["eta"] for r in rows)})
    colours = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(OBJECTIVES), figsize=(12, 4.8), sharey=True)
    for ax, objective in zip(axes, OBJECTIVES, strict=True):
        for eta in sorted({r["eta"] for r in rows}):
            runs = [r for r in rows if r["objective"] == objective and r["eta"] == eta]
            if not runs:
                continue
            colour = colours(etas.index(eta) / max(len(etas) - 1, 1) * 0.9)
            if len(runs) > 1:
                for r in runs:
                    ax.plot(*zip(*r["curve"], strict=True), color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(*mean_curve(runs), color=colour, linewidth=2, marker="o", markersize=3, label=f"η = {eta}")
        prox = "π_prox = π_behav" if objective == "naive" else "π_prox recomputed"
        ax.set_title(f"{objective} PPO ({prox})")
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0].set_ylabel("held-out greedy accuracy")
    axes[0].set_ylim(0, min(1.0, max(0.1, *(a for r in rows for _, a in r["curve"])) + 0.05))
    seeds = report["settings"]["seeds"]
    fig.suptitle(f"built-in task: accuracy vs staleness bound η, mean over {len(seeds)} seed(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_grid(configs: dict[Setting, RunConfig], progress: bool) -> tuple[list[dict], Setting | None]:
    """The rows of the runs that finished, in grid order, and the run that did not, if one did not."""
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
    return rows, None


def merge(reports: list[dict]) -> dict:
    """One report from several of the same settings run separately (seeds on other machines or days)."""
    first = reports[0]["settings"]
    for report in reports[1:]:
        differ = [k for k in ("steps", "eval_every", "tail_evals") if report["settings"][k] != first[k]]
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


def write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
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
    write(report, Path(args.out or "runs/bench/staleness.json"))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return run_merge(args)
    started = time.time()
    # saving and loading bars would break the bars over runs and steps
    transformers.utils.logging.disable_progress_bar()
    plan = plan_for(args)
    if plan.steps < 1 or args.eval_every < 1:
        print("asyncrl: --steps and --eval-every must be positive", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench/staleness{'-quick' if args.quick else ''}.json")
    runs_dir = out.parent / "staleness-runs"
    common = [
        *args.overrides,
        f"runs_dir={runs_dir}",
        f"trainer.steps={plan.steps}",
        f"eval.every={args.eval_every}",
        "telemetry.sample_ratio=0",
    ]
    shared = load_config(config_file(None), common)  # what every run has before its own eta, objective and seed
    if shared.data.source != "builtin":
        raise ConfigError("bench staleness measures held-out accuracy, which only the built-in task has")
    configs = run_configs(plan, common)
    print(
        f"bench staleness: {len(configs)} runs of {plan.steps} steps (eta {list(plan.etas)} x {list(OBJECTIVES)} "
        f"x seeds {list(plan.seeds)})",
        flush=True,
    )
    models = build_models(configs, runs_dir / f"models-{time.strftime('%Y%m%d-%H%M%S')}", not args.no_progress)
    models_seconds = time.time() - started
    configs = {s: with_model(c, models[s.seed]) if s.seed in models else c for s, c in configs.items()}
    rows, failed = run_grid(configs, not args.no_progress)
    report = {
        "cells": cells(rows),
        "rows": rows,
        "wall_seconds": round(time.time() - started, 1),
        "models_seconds": round(models_seconds, 1),
        "settings": {
            "quick": args.quick,
            "etas": list(plan.etas),
            "objectives": list(OBJECTIVES),
            "seeds": list(plan.seeds),
            "steps": plan.steps,
            "eval_every": args.eval_every,
            "tail_evals": TAIL_EVALS,
            "overrides": common,
            "models": models,
            "model": "demo Qwen2 (2.2M) warmed up once per seed, shared by every run of that seed",
            "config": msgspec.to_builtins(shared),
        },
        "machine": machine(),
    }
    write(report, out)
    if failed:
        print(f"asyncrl: the run {failed} did not finish; {out} has the {len(rows)} runs before it", file=sys.stderr)
        return 1
    return 0
