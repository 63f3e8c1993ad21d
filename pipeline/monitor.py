"""Following a running pipeline: progress bar, evaluation, restarts; then the run's report.

The trainer's lines in `metrics.jsonl` drive everything: the bar shows them, every
`eval.every` steps that weight version is queued for the run's evaluator process
(`workers.evaluator.worker`, which scores it on otherwise idle cores and appends an `eval` line
tagged with the version: greedy accuracy as `heldout_accuracy`, pass@1/pass@k/maj@k when
eval.k > 0; the rows under `eval/v<version>.jsonl`; an `eval_failed` line with the reason for a version it
could not score: an evaluation never fails the run), and the report (summary.json,
curves.png, TensorBoard) is built from the file alone, so it can be rebuilt for any run
directory. With `telemetry.wandb_project` set, every line also goes to W&B as it is written.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from tqdm import tqdm

from pipeline.config import ConfigError
from schemas.config import RunConfig
from workers import runtime
from workers.evaluator.worker import EvalRequests
from workers.reward.budget import EXIT_CODE as REWARD_BUDGET_EXIT
from workers.stats import percentile

MAX_RESTARTS = 3  # per worker; a worker that keeps failing ends the run as "failed"
ERROR_TAIL_LINES = 8  # of a failed worker's log, on the console
STATUS_EVERY_S = 30.0  # --no-progress: the longest gap between two status lines
EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(:|$)")  # a traceback's last line


def read_metrics(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete lines after byte `offset`, and the offset after them."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()], offset + end


class WandbStream:
    """metrics.jsonl into a W&B run, line by line. Each source has its own step axis (`trainer/step`,
    `eval/step`, `rollout/<worker>/step`): a restarted trainer repeats steps and eval lines come late,
    which W&B's single global step, increasing only, would drop."""

    def __init__(self, config: RunConfig, run_dir: Path):
        import wandb

        telemetry = config.telemetry
        try:
            self.run = wandb.init(
                project=telemetry.wandb_project,
                entity=telemetry.wandb_entity or None,
                mode=telemetry.wandb_mode or None,
                name=config.name,
                dir=run_dir,
                config=msgspec.to_builtins(config),
            )
        except wandb.errors.Error as exc:  # e.g. online without `wandb login`: say so before any worker starts
            raise ConfigError(f"W&B: {exc}") from None
        self.path, self.offset, self.axes = run_dir / "metrics.jsonl", 0, set()

    def sync(self) -> None:
        """Log the lines written since the last call."""
        lines, self.offset = read_metrics(self.path, self.offset)
        for line in lines:
            axis = "/".join([line["source"], line["worker"]] if "worker" in line else [line["source"]])
            if axis not in self.axes:
                self.run.define_metric(f"{axis}/*", step_metric=f"{axis}/step")
                self.axes.add(axis)
            self.run.log(
                {
                    f"{axis}/{key}": value
                    for key, value in line.items()
                    if key != "time" and isinstance(value, (int, float))
                }
            )

    def finish(self, summary: dict) -> None:
        import wandb

        self.sync()
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if summary["outcome"] == "finished" else 1)
        wandb.teardown()  # run.finish() may return before wandb-core has written the run's log; this waits for it


def failure_report(worker, code: int) -> str:
    """Why a worker gave up, on the console: the exception line and the end of its log (all of it in the file)."""
    try:
        with open(worker.log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 16_000))
            tail = [line[:240] for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        tail = []
    error = next((line for line in reversed(tail) if EXCEPTION_LINE.match(line)), "no exception line in its log")
    head = f"asyncrl: {worker.name} failed {worker.restarts + 1} times (exit {code}): {error}"
    return "\n".join(
        [head, *(f"    {line}" for line in tail[-ERROR_TAIL_LINES:]), f"    (all of it: {worker.log_path})"]
    )


def reward_verdict(lines: list[dict]) -> str | None:
    """Why the reward worker stopped the run (its failure budget was spent), from its last metrics line."""
    return next((l["stopped"] for l in reversed(lines) if l["source"] == "reward" and "stopped" in l), None)


def budget_spent(run_dir: Path, workers: list, codes: list[int | None]) -> str | None:
    """The reward worker's verdict once it exited on its failure budget: no restart, it would fail alike."""
    if not any(w.role == "reward" and code == REWARD_BUDGET_EXIT for w, code in zip(workers, codes, strict=True)):
        return None
    verdict = reward_verdict(read_metrics(run_dir / "metrics.jsonl")[0])
    return f"asyncrl: {verdict or 'the reward function failed too often (reward.max_failure_rate)'}; stopping"


def reward_summary(lines: list[dict]) -> dict:
    """The reward workers' counts (each one's last line, summed): calls, failures by kind, unscorable segments."""
    last = {l["worker"]: l for l in lines if l["source"] == "reward"}.values()
    failures: dict[str, int] = {}
    for line in last:
        for kind, count in line["reward_failures"].items():
            failures[kind] = failures.get(kind, 0) + count
    return {
        "reward_calls": sum(l["reward_calls"] for l in last),
        "reward_failures": failures,
        "unscorable_segments": sum(l["unscorable_segments"] for l in last),
    }


def restart_exited(workers: list, codes: list[int | None], bar: tqdm) -> bool:
    """Restart every worker that ended before its time; False once one has used up its restarts (the evaluator's
    failures cost the evaluation, never the run: the launcher notes its versions as failed at the end)."""
    for worker, code in zip(workers, codes, strict=True):
        # other workers end with 0 only when the final weights are out (or on a stop): done, not failed
        if code is not None and (code != 0 or worker.role == "trainer"):
            if worker.restarts >= MAX_RESTARTS:
                if worker.role == "eval":
                    if worker.restarts == MAX_RESTARTS:  # said once
                        bar.write(failure_report(worker, code) + "\n    the run goes on without evaluation")
                        worker.restarts += 1
                    continue
                bar.write(failure_report(worker, code))
                return False
            bar.write(f"asyncrl: {worker.name} exited with {code}; restarting it")
            worker.restarts += 1
            worker.start()
    return True


def run_outcome(
    config: RunConfig,
    run_dir: Path,
    workers: list,
    codes: list[int | None],
    step: int,
    started: float,
    bar: tqdm,
    longest_eval: float = 0.0,
) -> str | None:
    """'finished', 'failed' or 'timeout' once the run is over, None while it goes on (workers that ended before
    their time restarted). `longest_eval`: the longest evaluation's seconds so far (`final_eval_reserve`)."""
    if step >= config.trainer.steps and all(
        code == 0 for w, code in zip(workers, codes, strict=True) if w.role == "trainer"
    ):
        return "finished"
    if verdict := budget_spent(run_dir, workers, codes):
        bar.write(verdict)
        return "failed"
    if not restart_exited(workers, codes, bar):
        return "failed"
    if config.max_wall_s and time.time() - started > config.max_wall_s - final_eval_reserve(config, longest_eval):
        less = f" less {longest_eval:.0f} s for the final evaluation" if longest_eval else ""
        bar.write(f"asyncrl: max_wall_s={config.max_wall_s}{less} reached, stopping")
        return "timeout"
    return None


class StepDisplay:
    """A trainer step's numbers: the progress bar's postfix, or without a bar (--no-progress: a Slurm or CI log)
    a status line at the first and last steps and at most every STATUS_EVERY_S between."""

    def __init__(self, bar: tqdm, steps: int, progress: bool, clock: Callable[[], float] = time.monotonic):
        self.bar, self.steps, self.progress, self.clock, self.printed = bar, steps, progress, clock, -math.inf

    def show(self, line: dict, accuracy: float | None) -> None:
        held_out = "-" if accuracy is None else f"{accuracy:.2f}"
        if self.progress:
            self.bar.set_postfix(
                reward=f"{line['reward_mean']:.2f}",
                acc=held_out,
                stale=f"{line['staleness_mean']:.1f}",
                tok_s=f"{line['tokens_per_s']:.0f}",
                refresh=False,
            )
        elif self.clock() - self.printed >= STATUS_EVERY_S or line["step"] >= self.steps:
            self.printed = self.clock()
            print(
                f"asyncrl: step {line['step']}/{self.steps}, reward {line['reward_mean']:.2f}, held-out {held_out}, "
                f"staleness {line['staleness_mean']:.1f}, {line['tokens_per_s']:.0f} tok/s",
                flush=True,
            )


def final_eval_reserve(config: RunConfig, longest_eval: float) -> float:
    """Seconds of max_wall_s kept for scoring the last version once training stops: as long as the longest
    evaluation of the run so far (scored on cores the workers left over, so rather more than the last one needs
    with every core free), at most a quarter of the budget; 0 before any evaluation."""
    return min(longest_eval, config.max_wall_s / 4)


def follow(
    config: RunConfig,
    run_dir: Path,
    workers: list,
    evaluation: EvalRequests | None,
    started: float,
    progress: bool,
    wandb_stream: WandbStream | None = None,
    offset: int = 0,
    on_first_step: Callable[[], None] | None = None,
) -> str:
    """Until the trainer's last step: 'finished', 'timeout' or 'failed' (a stop signal raises through it).
    `evaluation`: where every eval.every-th version is asked for (None: no evaluation set).
    `offset`: where metrics.jsonl is read from (a resumed run's earlier lines are done with).
    `on_first_step`: called once, at the trainer's first line (the launcher starts its evaluator then)."""
    metrics_path = run_dir / "metrics.jsonl"
    accuracy, longest_eval = None, 0.0
    bar = tqdm(total=config.trainer.steps, desc="asyncrl", unit="step", disable=not progress, dynamic_ncols=True)
    display, step = StepDisplay(bar, config.trainer.steps, progress), 0
    try:
        while True:
            # exit codes before the metrics: a worker that ended after the trainer's last line is read as done
            codes = [worker.process.poll() for worker in workers]
            lines, offset = read_metrics(metrics_path, offset)
            if wandb_stream:
                wandb_stream.sync()
            if evaluation:
                evaluation.link_written()
            for line in lines:
                if line["source"] == "eval":  # scored behind the trainer, whenever a core was free
                    accuracy, longest_eval = line["heldout_accuracy"], max(longest_eval, line.get("seconds", 0.0))
                if line["source"] != "trainer":
                    continue
                bar.update(max(line["step"] - step, 0))  # a restarted trainer repeats steps after its checkpoint
                step = line["step"]
                if evaluation and config.eval.every and step % config.eval.every == 0 and step < config.trainer.steps:
                    evaluation.ask(step)  # the last step's version is asked for once the workers have stopped
                display.show(line, accuracy)
            if outcome := run_outcome(config, run_dir, workers, codes, step, started, bar, longest_eval):
                return outcome
            if on_first_step and step:  # after the workers were polled: it may add one
                on_first_step()
                on_first_step = None
            time.sleep(0.2)
    finally:
        bar.close()


def standing_steps(lines: list[dict]) -> list[dict]:
    """The trainer's lines of the steps that stand: a step trained again (a restarted trainer redoing it from
    its manifest, or a resumed run retraining steps lost with its broker) replaces the lines of that step and
    of every step after it."""
    kept: list[dict] = []
    for line in (l for l in lines if l["source"] == "trainer"):
        while kept and kept[-1]["step"] >= line["step"]:
            kept.pop()
        kept.append(line)
    return kept


def standing_lines(lines: list[dict]) -> list[dict]:
    """metrics.jsonl's lines that stand, in file order: no trainer line or evaluation of a step past the checkpoint
    a later `resume` line names (those weights were abandoned: the resumed run trains its own versions of those
    steps, or has not yet), the trainer's lines of `standing_steps` of the rest; every other line as it is."""
    kept, resumed_at = [], math.inf  # the earliest checkpoint a later launch resumed from
    for line in reversed(lines):
        if line["source"] == "resume":
            resumed_at = min(resumed_at, line["step"])
        elif line["source"] in ("trainer", "eval", "eval_failed") and line["step"] > resumed_at:
            continue
        kept.append(line)
    kept.reverse()
    steps = {id(line) for line in standing_steps(kept)}
    return [l for l in kept if l["source"] != "trainer" or id(l) in steps]


def note_start(run_dir: Path, resumed_from: int | None = None) -> int:
    """A line in metrics.jsonl as the workers start: `start`, or `resume` with the step of the checkpoint the
    run resumes from (summary.json lists them); the file's size after it, where the monitor starts reading."""
    path = run_dir / "metrics.jsonl"
    if resumed_from is None:
        runtime.MetricsWriter(path, "start").write(step=0)
    else:
        runtime.MetricsWriter(path, "resume").write(step=resumed_from)
    return path.stat().st_size


def sampled_eval_summary(base: dict | None, final: dict | None) -> dict:
    """With eval.k > 0: pass@1, pass@k and maj@k of the base model and of the last version, and k."""
    found = {"eval_k": (final or base or {}).get("k", 0)}
    for name, line in (("base", base), ("final", final)):
        for key in ("pass_at_1", "pass_at_k", "maj_at_k"):
            found[f"{name}_{key}"] = line.get(key) if line else None
    return found if found["eval_k"] else {}


def completion_length_summary(steps: list[dict]) -> dict[str, float]:
    """p50, p90 and max of the completion lengths (tokens) of every trajectory the trainer trained."""
    lengths = [n for line in steps for n in line.get("completion_lengths", ())]
    return {
        "completion_len_p50": percentile(lengths, 50),
        "completion_len_p90": percentile(lengths, 90),
        "completion_len_max": max(lengths, default=0),
    }


def eval_failure_summary(lines: list[dict]) -> dict:
    """The reward's failed calls during evaluation, by kind (timeout, died, the exception's type, ...), and the
    versions whose evaluation failed, with the reason."""
    failures: dict[str, int] = {}
    for line in lines:
        for kind, count in line.get("reward_failures", {}).items() if line["source"] in ("eval", "eval_failed") else ():
            failures[kind] = failures.get(kind, 0) + count
    failed = [{"version": l["version"], "reason": l["reason"]} for l in lines if l["source"] == "eval_failed"]
    return {"eval_failures": failures, "evals_failed": failed}


def what_ran(config: RunConfig) -> dict[str, str]:
    """The run's model, training data, evaluation data and reward as its config names them: a file's path, or the
    built-in task's rows."""
    data = config.data
    task = f"task {data.task}"
    source = data.eval_source_or_default()
    evaluation = {"builtin": f"{task}: held-out split ({data.held_out} problems)"}.get(source, source)
    return {
        "model": config.model.path,
        "data": task if data.source == "builtin" else data.source,
        "eval_data": evaluation,
        "reward": f"{task}: its verifier" if data.reward == "builtin" else data.reward,
        "template": data.template,
    }


def trajectory_shares(last: dict) -> dict[str, float | None]:
    """Of the trajectories trained, the share interrupted by a weight update and the share cut at the output budget
    (finish reason `length`: raise rollout.max_new_tokens, or add rollout.stop, when it is large)."""
    trained = last.get("trained_trajectories", 0)
    return {
        f"{kind}_share": round(last.get(f"{kind}_trajectories", 0) / trained, 4) if trained else None
        for kind in ("interrupted", "truncated")
    }


def final_version(run_dir: Path) -> int | None:
    """The version of the run's last standing step (what the final evaluation scores), None before any."""
    steps = standing_steps(standing_lines(read_metrics(run_dir / "metrics.jsonl")[0]))
    return steps[-1]["step"] if steps else None


def peak_memory(lines: list[dict]) -> dict[str, int]:
    """Each role's largest peak resident memory (MB) over its processes' metrics lines: trainer, rollout, eval..."""
    peaks: dict[str, int] = {}
    for line in lines:
        if "peak_rss_mb" in line:
            peaks[line["source"]] = max(peaks.get(line["source"], 0), line["peak_rss_mb"])
    return peaks


def finish(
    config: RunConfig,
    run_dir: Path,
    outcome: str,
    started: float,
    wandb_stream: WandbStream | None = None,
    reason: str | None = None,
) -> dict:
    """summary.json (`reason`: why a run stopped or failed, when the launcher knows), curves.png,
    TensorBoard events and the W&B run's summary, all from the lines that stand (`standing_lines`); the final
    accuracy is the evaluation of the last step's version, when there is one (the launcher asks for it once the
    workers have stopped)."""
    lines = standing_lines(read_metrics(run_dir / "metrics.jsonl")[0])
    steps = standing_steps(lines)
    last = steps[-1] if steps else {}
    evals = [l for l in lines if l["source"] == "eval"]
    final = next((l for l in reversed(evals) if last and l["version"] == last["step"]), None)
    base = next((l for l in evals if l.get("version") == 0), None)
    summary = {
        "run": config.name,
        "outcome": outcome,
        "reason": reason or reward_verdict(lines),
        **what_ran(config),
        "base_accuracy": base["heldout_accuracy"] if base else None,
        "final_accuracy": final["heldout_accuracy"] if final else None,
        "n": (final or base or {}).get("n"),  # held-out rows behind each accuracy
        **sampled_eval_summary(base, final),
        "steps": last.get("step", 0),
        "max_staleness": config.trainer.max_staleness,
        "max_staleness_trained": last.get("max_staleness_trained", 0),
        "trained_tokens": last.get("trained_tokens", 0),
        "trained_trajectories": last.get("trained_trajectories", 0),
        "interrupted_trajectories": last.get("interrupted_trajectories", 0),
        "truncated_trajectories": last.get("truncated_trajectories", 0),
        **trajectory_shares(last),
        **completion_length_summary(steps),
        "mixed_version_trajectories": last.get("mixed_version_trajectories", 0),
        "groups_consumed": last.get("groups_consumed", 0),
        "groups_dropped": last.get("groups_dropped", 0),
        "skipped_steps": last.get("skipped_steps", 0),
        **reward_summary(lines),
        **eval_failure_summary(lines),
        "trained_tokens_per_s": last.get("tokens_per_s", 0.0),
        "resumed_from": [l["step"] for l in lines if l["source"] == "resume"],  # checkpoint steps, one per resume
        "wall_seconds": round(time.time() - started, 1),
        "peak_rss_mb": peak_memory(lines),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from pipeline.report import plot_curves, write_tensorboard

    plot_curves(lines, run_dir / "curves.png")
    write_tensorboard(lines, run_dir / "tensorboard")
    if wandb_stream:
        wandb_stream.finish(summary)
    return summary
