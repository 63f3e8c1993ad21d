"""Plots and TensorBoard events from the lines of metrics.jsonl."""

from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _series(lines: list[dict], source: str, key: str) -> tuple[list[int], list[float]]:
    points = [(l["step"], l[key]) for l in lines if l["source"] == source and l.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _rolling(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_curves(lines: list[dict], path: Path) -> None:
    """Reward, evaluation (greedy accuracy; pass@1, pass@k and maj@k when sampled) and staleness per step."""
    fig, (reward_ax, accuracy_ax, stale_ax) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    steps, rewards = _series(lines, "trainer", "reward_mean")
    reward_ax.plot(steps, rewards, alpha=0.3, label="per step")
    reward_ax.plot(steps, _rolling(rewards), label="rolling mean (20)")
    reward_ax.set_ylabel("training reward")
    reward_ax.legend(loc="lower right")
    plot_eval(accuracy_ax, lines)
    for key, label in (("staleness_mean", "mean"), ("staleness_max", "max")):
        stale_ax.plot(*_series(lines, "trainer", key), label=label)
    stale_ax.set_ylabel("staleness (versions)")
    stale_ax.set_xlabel("trainer step")
    stale_ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


EVAL_SERIES = (("heldout_accuracy", "greedy"), ("pass_at_1", "pass@1"), ("maj_at_k", "maj@k"), ("pass_at_k", "pass@k"))


def plot_eval(ax, lines: list[dict]) -> None:
    """Every evaluated version's scores (eval lines' step is the version scored)."""
    k = next((l["k"] for l in lines if l["source"] == "eval" and l.get("k")), 0)
    for key, label in EVAL_SERIES:
        steps, values = _series(lines, "eval", key)
        if steps:
            ax.plot(steps, values, marker="o", label=label if key == "heldout_accuracy" else f"{label} (k={k})")
    ax.set_ylabel("evaluation accuracy")
    ax.set_ylim(0, 1)
    if not any(l["source"] == "eval" for l in lines):
        nothing = "no evaluation (no data.eval_source, or eval.enabled=false)"
        ax.text(0.5, 0.5, nothing, transform=ax.transAxes, ha="center", va="center")
    if k:
        ax.legend(loc="upper left", ncols=4)


def write_tensorboard(lines: list[dict], directory: Path) -> None:
    """The lines as TensorBoard events, written anew: a resumed run's launches each write every line that stands,
    and TensorBoard would show an earlier launch's file beside the new one."""
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(directory, ignore_errors=True)
    with SummaryWriter(str(directory)) as writer:
        for line in lines:
            for key, value in line.items():
                if key not in ("step", "time", "source") and isinstance(value, (int, float)):
                    writer.add_scalar(f"{line['source']}/{key}", value, line["step"], walltime=line["time"])
            if line.get("staleness_histogram"):  # trajectories per staleness (versions behind the trainer)
                lags = [lag for lag, count in enumerate(line["staleness_histogram"]) for _ in range(count)]
                writer.add_histogram(f"{line['source']}/staleness", np.array(lags), line["step"], walltime=line["time"])
