"""What `asyncrl chaos` prints and keeps: a row per role for the kills, a line per check for the poison, as a
table on the console, as JSON, and the kills as a plot."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pipeline.chaos.kills import RunResult

COLUMNS = ("role", "runs", "trials", "lost", "duplicated", "completed", "leftover", "seconds", "verdict")


def role_row(role: str, runs: list[RunResult], target: int) -> dict:
    """One role's runs summed: kills of that role, groups lost, trajectories trained twice, runs completed."""
    audits = [run.audit for run in runs if run.audit is not None]
    problems = [p for a in audits for p in a.problems] + [run.error for run in runs if run.error]
    row = {
        "role": role,
        "runs": len(runs),
        "trials": sum(1 for run in runs for kill in run.kills if kill.role == role),
        "lost": sum(len(a.lost) for a in audits),
        "duplicated": sum(len(a.duplicated) for a in audits),
        "completed": f"{sum(run.completed for run in runs)}/{len(runs)}",
        "leftover": sum(len(run.leftover) for run in runs),
        "seconds": round(sum(run.seconds for run in runs), 1),
        "problems": problems,
    }
    clean = not (row["lost"] or row["duplicated"] or row["leftover"] or problems)
    passed = clean and all(run.completed for run in runs) and row["trials"] >= target
    row["verdict"] = "pass" if passed else "FAIL" if not clean or not all(r.completed for r in runs) else "too few"
    return row


def unavailable_row(role: str, why: str) -> dict:
    return {"role": role, **dict.fromkeys(COLUMNS[1:-1], "-"), "verdict": why, "problems": []}


def table(rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> str:
    """Rows as a fixed-width text table."""
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def kills_report(rows: list[dict], results: dict[str, list[RunResult]], settings: dict, seconds: float) -> dict:
    return {
        "cores": os.cpu_count(),
        "wall_seconds": round(seconds, 1),
        "settings": settings,
        "roles": rows,
        "runs": {role: [dataclasses.asdict(run) for run in runs] for role, runs in results.items()},
    }


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def plot_kills(rows: list[dict], path: Path) -> None:
    """Kills per role (green: every check held, red: not, grey: not available), labelled with the seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    heights = [row["trials"] if isinstance(row["trials"], int) else 0 for row in rows]
    colours = [{"pass": "tab:green", "FAIL": "tab:red"}.get(row["verdict"], "tab:grey") for row in rows]
    bars = ax.bar([row["role"] for row in rows], heights, color=colours)
    for bar, row in zip(bars, rows, strict=True):
        label = f"{row['seconds']:.0f} s" if isinstance(row["seconds"], float) else "n/a"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("SIGKILLs")
    ax.set_title("asyncrl chaos: kills per role (green: every check held)")
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def poison_lines(report: dict, top: int = 25) -> list[str]:
    """The poison report for the console: what was sent, the dead letters by reason, the checks, the accuracy."""
    poisoned, clean = report["poisoned"], report["clean"]
    sent = poisoned.get("poison_sent", {})
    lines = [
        f"poison: {sent.get('table', 0)} records of {sent.get('table_kinds', 0)} kinds, {sent.get('random', 0)} "
        f"random records ({sent.get('random_still_valid_not_sent', 0)} mutations still valid, not sent), "
        f"{report['bad_rows']} bad dataset rows",
        f"dead letters by worker: {poisoned.get('dead_letters_by_reader', {})}",
        "dead letters by reason (numbers and quoted values masked):",
        *[f"  {n:6d}  {reason}" for reason, n in list(poisoned.get("dead_letters_by_reason", {}).items())[:top]],
    ]
    if missing := poisoned.get("not_dead_lettered"):
        lines.append(f"not dead-lettered ({len(missing)}): {missing[:10]}")
    if audit := poisoned.get("audit"):
        lines.append(
            f"groups: {audit['released']} released, {audit['trained_groups']} trained, {audit['dropped_groups']} "
            f"dropped, lost {audit['lost'][:10]}, trained twice {audit['duplicated'][:10]}; {audit['problems'][:3]}"
        )
    if poisoned.get("error"):
        lines.append(f"run: {poisoned['error']}")
    accuracy = poisoned.get("accuracy", {})
    lines.append(
        f"held-out accuracy: base {accuracy.get('base')}, clean run {clean['accuracy']['final'] if clean else '-'}, "
        f"poisoned run {accuracy.get('poisoned')}"
    )
    lines += [f"  [{'ok' if held else 'FAILED'}] {name}" for name, held in report["checks"].items()]
    return lines
