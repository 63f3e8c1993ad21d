"""`asyncrl chaos`: the kill trials role by role within a time budget, or (--poison) the poison harness; a table
on the console, JSON (and a plot) in --out; exit 0 only when every check held."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from tqdm import tqdm

from pipeline.chaos import report
from pipeline.chaos.kills import RESUME_ROLES, WORKER_ROLES, RunResult, Settings, resume_run, worker_run
from pipeline.chaos.poisoning import PoisonSettings, run_poison
from pipeline.chaos.runs import resume_available

NO_RESUME = "not available: `asyncrl run --help` lists no --resume"


def chaos_command(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    return poison_command(args, out) if args.poison else kill_command(args, out)


def kill_command(args: argparse.Namespace, out: Path) -> int:
    """Every role in turn, runs of up to --kills-per-run kills each, until --trials kills or its share of time."""
    from pipeline.monitor import MAX_RESTARTS  # a worker's 4th death ends its run as failed: by design, not a trial

    settings = Settings(out, steps=args.steps or 60, seed=args.seed, overrides=tuple(args.overrides))
    started, rng = time.monotonic(), random.Random(args.seed)
    resume = resume_available() if set(args.roles) & set(RESUME_ROLES) else False
    bar = tqdm(total=args.trials * len(args.roles), unit="kill", desc="chaos", disable=args.no_progress)
    results: dict[str, list[RunResult]] = {}
    rows = []
    for n, role in enumerate(args.roles):
        if role in RESUME_ROLES and not resume:
            rows.append(report.unavailable_row(role, NO_RESUME))
            continue
        share_s = (started + args.minutes * 60 - time.monotonic()) / (len(args.roles) - n)
        per_run = min(args.kills_per_run, MAX_RESTARTS) if role in WORKER_ROLES else args.resume_kills_per_run
        results[role] = role_runs(role, settings, per_run, args.trials, time.monotonic() + share_s, rng, bar)
        rows.append(report.role_row(role, results[role], args.trials))
    bar.close()
    seconds = time.monotonic() - started
    print(report.table(rows))
    print(f"{sum(r['trials'] for r in rows if isinstance(r['trials'], int))} kills in {seconds / 60:.1f} min")
    for row in rows:
        for problem in row["problems"][:5]:
            print(f"  {row['role']}: {problem}")
    data = report.kills_report(rows, results, vars(args) | {"out": str(out)}, seconds)
    report.write_json(data, out / "chaos.json")
    report.plot_kills(rows, out / "chaos.png")
    print(f"written: {out / 'chaos.json'}, {out / 'chaos.png'}")
    return 0 if all(row["verdict"] in ("pass", NO_RESUME) for row in rows) else 1


def role_runs(
    role: str, settings: Settings, per_run: int, trials: int, deadline: float, rng: random.Random, bar: tqdm
) -> list[RunResult]:
    """Runs killing `role` until `trials` kills are done or `deadline` has passed (a run is never cut short)."""
    runs: list[RunResult] = []
    kills = 0

    def on_kill(kill) -> None:
        bar.update(1)
        bar.set_postfix(role=kill.role, run=len(runs), step=kill.trainer_step)

    while kills < trials and time.monotonic() < deadline:
        plan, index = [role] * min(per_run, trials - kills), sum(1 for _ in settings.out.glob("runs/*"))
        run = (worker_run if role in WORKER_ROLES else resume_run)(settings, plan, index, rng, on_kill)
        runs.append(run)
        kills += len(run.kills)
        if not run.kills:  # the run ended before the first kill could land: another would too
            break
    return runs


def poison_command(args: argparse.Namespace, out: Path) -> int:
    settings = PoisonSettings(
        out,
        steps=args.steps or 120,
        messages=args.messages,
        bad_rows=args.bad_rows,
        warm=not args.no_clean,
        clean=not args.no_clean,
        seed=args.seed,
        overrides=tuple(args.overrides),
        skip_kinds=tuple(args.skip_kind),
    )
    data = run_poison(settings, progress=not args.no_progress)
    print("\n".join(report.poison_lines(data)))
    report.write_json(data, out / "poison.json")
    print(f"written: {out / 'poison.json'}")
    return 0 if all(data["checks"].values()) else 1
