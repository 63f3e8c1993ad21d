"""`asyncrl bench pipeline`: the whole pipeline, synchronous against asynchronous, back to back.

Three runs of `asyncrl run` on the same task, model, data and machine, differing only in
the staleness bound and interruption:

- sync: eta = 0, the synchronous baseline (generation and training alternate);
- async: eta = 4 with interruption (the default asyncrl setting);
- async_no_interrupt: eta = 4, in-flight sequences finish on the old weights first.

Each run's config is the shipped config of `--task` (pipeline/configs/<task>.yaml; default
`chain`, whose worked solutions are long-tailed, ~16 to ~250 tokens, as reasoning traces are)
plus the bench's own settings. The model is the task's demo model, warmed up as `asyncrl run`
warms it for `--seed`, built once and shared by the three runs; outputs end at its end token
or at `--max-new-tokens` (default: the task's). Effective training throughput is the completion
tokens consumed by PPO updates per second after the first `--warmup-steps` steps; generation
throughput is the tokens the rollout worker emitted per second over the same window. Where
the time goes: the trainer's share of the window spent in its steps, the cores each role was
given (processes x threads, `cores_given`, against the machine's) and the cores each used over
the window (sampled from /proc, `cpu_cores`). What bounds the ratio (`cpu_bound`): each run's
core-seconds per step, and the async/sync ratio the async run's work per step would give with
every usable core busy: the ceiling of this machine, short of doing less work per step.

The learning rate is tiny by default (`--lr`): the training compute is the same, but
the policy stays put, so every run generates the same length distribution. With a
real learning rate the lengths drift during the run, and differently per variant
(measured on arith at lr 1e-4: 18 -> 12 tokens per completion over 60 sync steps, 18 -> 7
async), which would mix learning dynamics into a throughput ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipeline.bench import (
    build_demo_model,
    cores_given,
    cores_line,
    machine,
    run_to_end,
    task_config,
    task_label,
    times,
    with_model,
)
from pipeline.bench.cpu import CpuSampler
from pipeline.config import resolve
from pipeline.monitor import read_metrics
from schemas.config import RunConfig

VARIANTS = {
    "sync": ["trainer.max_staleness=0", "rollout.interrupt=true"],
    "async": ["trainer.max_staleness=4", "rollout.interrupt=true"],
    "async_no_interrupt": ["trainer.max_staleness=4", "rollout.interrupt=false"],
}


def window_rates(lines: list[dict], warmup_steps: int) -> dict:
    """Trained and generated tokens per second between the end of warm-up and the last step, and
    where the time went: the trainer's share of the window spent in its steps (near 1: trainer-bound)."""
    steps = [l for l in lines if l["source"] == "trainer"]
    first = next(l for l in steps if l["step"] >= warmup_steps)
    last = steps[-1]
    measured = [l for l in steps if l["step"] > first["step"]]
    seconds = last["time"] - first["time"]
    rollout = [l for l in lines if l["source"] == "rollout" and first["time"] <= l["time"] <= last["time"]]
    generated = sum(tokens / seconds for tokens, seconds in worker_changes(rollout, "generated_tokens") if seconds)
    return {
        "steps_measured": last["step"] - first["step"],
        "seconds": round(seconds, 2),
        "trained_tokens_per_s": round((last["trained_tokens"] - first["trained_tokens"]) / seconds, 1),
        "steps_per_s": round((last["step"] - first["step"]) / seconds, 3),
        "generated_tokens_per_s": round(generated, 1) if generated else None,
        "staleness_mean": round(sum(l["staleness_mean"] for l in measured) / len(measured), 2),
        "train_step_seconds": round(sum(l["step_seconds"] for l in measured) / len(measured), 3),
        "trainer_busy": round(sum(l["step_seconds"] for l in measured) / seconds, 3),
        "interrupted_trajectories": last["interrupted_trajectories"],
        "trained_tokens": last["trained_tokens"],
        "step_breakdown": step_breakdown(measured),
        **weights_costs(measured, rollout),
        **engine_use(rollout),
        "window": (first["time"], last["time"]),
    }


def worker_changes(rollout: list[dict], field: str) -> list[tuple[float, float]]:
    """(how much `field` grew, over how many seconds) between each rollout worker's first and last line:
    the workers' counters are their own, so several workers' lines are never subtracted from one another."""
    by_worker: dict[str, list[dict]] = {}
    for line in rollout:
        if field in line:
            by_worker.setdefault(line.get("worker", ""), []).append(line)
    return [(l[-1][field] - l[0][field], l[-1]["time"] - l[0]["time"]) for l in by_worker.values() if len(l) > 1]


def weights_costs(steps: list[dict], rollout: list[dict]) -> dict[str, float | None]:
    """Milliseconds per weight version: the trainer's write and hash of its file (off the step's path, on a
    core all the same) and the rollout worker's interruption, read, hash and load (None without those fields)."""
    writes = [l["write_seconds"] for l in steps if l.get("write_seconds")]
    loaded = sum(count for count, _ in worker_changes(rollout, "weight_loads"))
    load_seconds = sum(seconds for seconds, _ in worker_changes(rollout, "weights_load_seconds"))
    return {
        "write_ms_per_version": round(1000 * sum(writes) / len(writes), 2) if writes else None,
        "load_ms_per_version": round(1000 * load_seconds / loaded, 2) if loaded else None,
    }


def engine_use(rollout: list[dict]) -> dict[str, float | None]:
    """What the rollout workers' engines did: rows per step (the batch a forward ran: few rows cost more per
    token), the share of the workers' time spent in engine steps, and engine milliseconds per token."""
    steps = sum(count for count, _ in worker_changes(rollout, "engine_steps"))
    tokens = sum(count for count, _ in worker_changes(rollout, "engine_tokens"))
    busy = worker_changes(rollout, "engine_seconds")
    seconds, wall = sum(spent for spent, _ in busy), sum(window for _, window in busy)
    return {
        "engine_rows_per_step": round(tokens / steps, 1) if steps else None,
        "engine_busy": round(seconds / wall, 3) if wall else None,
        "engine_ms_per_token": round(1000 * seconds / tokens, 3) if tokens else None,
    }


def step_breakdown(steps: list[dict]) -> dict[str, float]:
    """Mean seconds per trainer step in each phase it times (`time_*`: the wait for a batch, manifest, collate,
    pi_prox, forward/backward, optimizer, publish, announce, checkpoint); 'train' holds the four between, and
    'wait_due' is the part of 'wait' in which a due group's straggler held a ready batch back."""
    phases = sorted({key for line in steps for key in line if key.startswith("time_")})
    return {
        phase.removeprefix("time_"): round(sum(l.get(phase, 0.0) for l in steps) / len(steps), 4) for phase in phases
    }


def cpu_bound(runs: dict[str, dict], usable_cores: int) -> dict | None:
    """Each run's CPU work per step (the cores all roles used over its window / its steps per second) and what
    async's work allows: its steps per second with every usable core busy, and that over sync's steps per second.
    None where a run's window held fewer than two of the CPU sampler's samples (a window under its interval)."""
    if not all(r["cpu_cores"] for r in runs.values()):
        return None
    per_step = {name: sum(r["cpu_cores"].values()) / r["steps_per_s"] for name, r in runs.items()}
    ceiling = usable_cores / per_step["async"]
    return {
        "core_seconds_per_step": {name: round(seconds, 3) for name, seconds in per_step.items()},
        "async_ceiling_steps_per_s": round(ceiling, 3),
        "async_ceiling_over_sync": round(ceiling / runs["sync"]["steps_per_s"], 3),
    }


def rollout_bound(run: dict, cores: dict) -> str | None:
    """In words, when a run's rollout workers kept the cores they were given busy while others stood idle:
    generation is the bottleneck, and more workers would use the idle cores. None otherwise."""
    given = cores["rollout"]["processes"] * cores["rollout"]["threads"]
    used, idle = run["cpu_cores"].get("rollout", 0.0), cores["usable_cores"] - sum(run["cpu_cores"].values())
    if used < 0.9 * given or idle < 0.4:  # unmeasured ({}) uses 0 of its cores: no hint
        return None
    workers = cores["rollout"]["processes"] + 1
    return (
        f"the rollout worker(s) used {used:.2f} of the {given} core(s) given them while {idle:.2f} stood idle: "
        f"generation bounds this run; more workers can use the idle cores "
        f"(rollout.workers={workers} broker.partitions={workers})"
    )


def straggler_bound(run: dict) -> str | None:
    """In words, when most of a run's trainer wait was for the stragglers of groups due at their staleness deadline
    while a batch of other complete groups was ready (`wait_due`). None otherwise, or when the wait is short."""
    wait, due = run["step_breakdown"].get("wait", 0.0), run["step_breakdown"].get("wait_due", 0.0)
    if wait < 0.05 or due < 0.5 * wait:
        return None
    return (
        f"the trainer waited {wait:.3f} s a step, {due:.3f} s of it for stragglers of groups due at their staleness "
        "deadline while a batch was ready: long answers hold training back (a larger trainer.max_staleness gives "
        "them more versions; with trainer.max_in_flight, at no more staleness for the others)"
    )


def out_path(args: argparse.Namespace) -> Path:
    return Path(args.out or f"runs/bench/pipeline-{task_label(args.task)}.json")


def variant_configs(args: argparse.Namespace) -> tuple[dict[str, RunConfig], int]:
    """Every variant's config (the task's shipped one, the bench's settings, the variant's), and the
    output length limit they share: `--max-new-tokens`, else the task's (its config's, resolved)."""
    common = [
        f"runs_dir={out_path(args).parent / 'pipeline-runs'}",
        f"trainer.steps={args.steps}",
        "eval.every=0",
        f"trainer.batch_groups={args.batch_groups}",
        f"data.n_samples={args.n_samples}",
        f"seed={args.seed}",
        "telemetry.sample_ratio=0",
        f"trainer.optim.lr={args.lr}",
        *args.overrides,
    ]
    max_new_tokens = args.max_new_tokens or resolve(task_config(args.task, common)).rollout.max_new_tokens
    common.append(f"rollout.max_new_tokens={max_new_tokens}")
    configs = {
        name: task_config(args.task, [*common, *overrides, f"name=bench-{name}"])
        for name, overrides in VARIANTS.items()
    }
    return configs, max_new_tokens


def shared_model(configs: dict[str, RunConfig], progress: bool) -> dict[str, RunConfig]:
    """The configs with one demo model, built for the task and seed, shared by every run (none if model.path is set)."""
    first = next(iter(configs.values()))
    if first.model.path:
        return configs
    task = first.data.task.replace("/", "_").replace(":", "_")  # a plug-in's path:Class makes one folder name
    where = Path(first.runs_dir) / f"models-{time.strftime('%Y%m%d-%H%M%S')}" / f"{task}-seed{first.seed}"
    path = build_demo_model(first, where, progress)
    return {name: with_model(config, path) for name, config in configs.items()}


def measure_variants(configs: dict[str, RunConfig], args: argparse.Namespace) -> dict[str, dict] | None:
    """Each variant run to the end, with its rates and the cores each role used; None if one did not finish."""
    results = {}
    for name, config in configs.items():
        print(f"== {name}: {' '.join(VARIANTS[name])}", flush=True)
        with CpuSampler() as cpu:
            run_dir = run_to_end(config, progress=not args.no_progress)
        if run_dir is None:
            print(f"asyncrl: the {name} run did not finish", flush=True)
            return None
        lines, _ = read_metrics(run_dir / "metrics.jsonl")
        rates = window_rates(lines, args.warmup_steps)
        results[name] = {"run_dir": str(run_dir), **rates, "cpu_cores": cpu.cores(*rates.pop("window"))}
        results[name]["mean_completion_tokens"] = round(
            results[name]["trained_tokens"] / (args.steps * args.batch_groups * args.n_samples), 1
        )
    return results


def run(args: argparse.Namespace) -> int:
    configs, max_new_tokens = variant_configs(args)
    configs = shared_model(configs, progress=not args.no_progress)
    results = measure_variants(configs, args)
    if results is None:
        return 1
    config, info = configs["async"], machine()
    report = {
        "async_over_sync": round(results["async"]["trained_tokens_per_s"] / results["sync"]["trained_tokens_per_s"], 3),
        "interrupt_on_over_off": ratio(
            results["async"]["generated_tokens_per_s"], results["async_no_interrupt"]["generated_tokens_per_s"]
        ),
        "interrupt_on_over_off_trained": round(
            results["async"]["trained_tokens_per_s"] / results["async_no_interrupt"]["trained_tokens_per_s"], 3
        ),
        "cores_given": cores_given(config, info["cpu_count"], info["usable_cores"]),
        "cpu_bound": cpu_bound(results, info["usable_cores"]),
        "runs": results,
        "settings": {
            **vars(args),
            "out": str(out_path(args)),
            "max_new_tokens": max_new_tokens,
            "task": config.data.task,
            "task_config": args.task,
            "variants": VARIANTS,
            "model": f"the {config.data.task} task's demo model ({config.model.path}), warmed up as `asyncrl run` "
            "does for the seed, shared by the three runs",
            "workload": f"the {config.data.task} task's own prompts; outputs end at the model's end token "
            "or at max_new_tokens",
        },
        "machine": info,
    }
    print(table(report))
    out = out_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"task {s['task']}: {s['steps']} steps of {s['batch_groups']} x {s['n_samples']} samples, "
        f"outputs up to {s['max_new_tokens']} tokens, measured after step {s['warmup_steps']}",
        f"{'run':<20} {'trained tok/s':>13} {'steps/s':>8} {'generated tok/s':>15} {'staleness':>9} "
        f"{'interrupted':>11} {'trainer busy':>12}",
    ]
    for name, r in report["runs"].items():
        lines.append(
            f"{name:<20} {r['trained_tokens_per_s']:>13.1f} {r['steps_per_s']:>8.3f} "
            f"{r['generated_tokens_per_s'] or 0:>15.1f} {r['staleness_mean']:>9.2f} "
            f"{r['interrupted_trajectories']:>11} {r['trainer_busy']:>12.0%}"
        )
    lines.append(cores_line(report["cores_given"]))
    for name, r in report["runs"].items():
        cores = ", ".join(f"{role} {used:.2f}" for role, used in r["cpu_cores"].items())
        total = f" (total {sum(r['cpu_cores'].values()):.2f})" if cores else "not measured"
        lines.append(f"{name} cores used: {cores}{total}")
    bound = report["cpu_bound"]
    if bound is None:
        lines.append("core-seconds per step: not measured (a run's window was shorter than the CPU sampler's interval)")
    else:
        lines.append(
            "core-seconds per step: "
            + ", ".join(f"{name} {seconds:.2f}" for name, seconds in bound["core_seconds_per_step"].items())
            + f"; all {report['cores_given']['usable_cores']} usable cores busy with async's work: "
            f"{bound['async_ceiling_steps_per_s']:.3f} steps/s, {bound['async_ceiling_over_sync']:.2f}x sync "
            "(this machine's ceiling)"
        )
    for hint in (
        rollout_bound(report["runs"]["async"], report["cores_given"]),
        straggler_bound(report["runs"]["async"]),
    ):
        if hint:
            lines.append(f"async: {hint}")
    lines.append("trainer step breakdown, mean seconds per step:")
    for name, r in report["runs"].items():
        lines.append(f"  {name}: " + ", ".join(f"{phase} {s:.3f}" for phase, s in r["step_breakdown"].items()))
    lines.append("weights per version, ms: trainer write + hash | rollout interrupt + read, hash and load")
    for name, r in report["runs"].items():
        lines.append(f"  {name}: {r['write_ms_per_version']} | {r['load_ms_per_version']}")
    lines.append("rollout engines: rows per step | share of the workers' time in steps | ms per token")
    for name, r in report["runs"].items():
        lines.append(f"  {name}: {r['engine_rows_per_step']} | {r['engine_busy']} | {r['engine_ms_per_token']}")
    lines.append(f"async/sync effective training throughput: {times(report['async_over_sync'])}")
    lines.append(
        f"interruption on/off generation throughput: {times(report['interrupt_on_over_off'])} "
        f"(training throughput {times(report['interrupt_on_over_off_trained'])})"
    )
    return "\n".join(lines)
