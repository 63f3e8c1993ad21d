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

`--model DIR|short-name` runs the three on a real model instead, with the shipped real-model config
(`smollm2-math`: wordmath in the chat template, its batch, learning rate, output limit, temperature and loss
aggregation; `--steps`, `--eval-rows` shorten it). Each run's model FLOPs utilisation (`workers/flops.py`):
the trainer's own `fb_gflops` and `fb_mfu` (its forwards and backwards), and the rollout's, 2·N per generated
token over the window against one core's matmul ceiling in the runs' dtype, probed here before the runs, × the
cores the rollout was given.

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
    bench_task,
    build_demo_model,
    cores_given,
    cores_line,
    machine,
    model_overrides,
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
from workers import flops

DEMO_TASK = "chain"
# the bench's own steps, batch and learning rate on a demo model (tiny: the policy stays put, see above)
DEMO_SETTINGS = {"trainer.steps": 60, "trainer.batch_groups": 8, "data.n_samples": 8, "trainer.optim.lr": 1e-9}
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
    fb = {key: mean_of(measured, key) for key in ("fb_gflops", "fb_mfu")}  # the trainer's own, over its fb time
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
        **fb,
        **weights_costs(measured, rollout),
        **engine_use(rollout),
        "window": (first["time"], last["time"]),
    }


def mean_of(lines: list[dict], field: str) -> float | None:
    """The mean of `field` over the lines that have it; None where none has."""
    values = [line[field] for line in lines if field in line]
    return round(sum(values) / len(values), 4) if values else None


def rollout_utilisation(rollout: list[dict], shape: dict | None, ceiling: float, cores: int) -> dict:
    """The rollout workers' model GFLOP/s, each worker's generated tokens over its time summed (2·N a token: the
    matmuls of the forward that sampled it; attention and the prompts' prefill left out, so a floor), and their
    MFU over `ceiling` GFLOP/s a core × the `cores` given them. None where not counted or not measured."""
    changes = worker_changes(rollout, "generated_tokens") if shape else []
    achieved = sum(flops.gflops(flops.forward_flops(shape, tokens, 0), s) for tokens, s in changes if s)
    return {
        "rollout_gflops": round(achieved, 3) if achieved else None,
        "rollout_mfu": round(flops.mfu(achieved, ceiling, cores), 4) if achieved and ceiling else None,
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
    return Path(args.out or f"runs/bench/pipeline-{task_label(bench_task(args, DEMO_TASK))}.json")


def bench_settings(args: argparse.Namespace) -> list[str]:
    """The runs' steps, batch and learning rate: those given, else on a demo model the bench's (`DEMO_SETTINGS`),
    on --model's the config's own."""
    given = dict(zip(DEMO_SETTINGS, (args.steps, args.batch_groups, args.n_samples, args.lr), strict=True))
    defaults = {} if args.model else DEMO_SETTINGS
    chosen = {key: defaults.get(key) if value is None else value for key, value in given.items()}
    return [f"{key}={value}" for key, value in chosen.items() if value is not None]


def variant_configs(args: argparse.Namespace) -> tuple[dict[str, RunConfig], int]:
    """Every variant's config (the task's shipped one, the bench's settings, the variant's), and the
    output length limit they share: `--max-new-tokens`, else the task's (its config's, resolved)."""
    task = bench_task(args, DEMO_TASK)
    common = [
        f"runs_dir={out_path(args).parent / 'pipeline-runs'}",
        *model_overrides(args),
        *bench_settings(args),
        "eval.every=0",
        "max_wall_s=0",  # every variant runs every step (smollm2-math's own limit would cut the slower ones)
        f"seed={args.seed}",
        "telemetry.sample_ratio=0",
        *args.overrides,
    ]
    max_new_tokens = args.max_new_tokens or resolve(task_config(task, common)).rollout.max_new_tokens
    common.append(f"rollout.max_new_tokens={max_new_tokens}")
    configs = {
        name: task_config(task, [*common, *overrides, f"name=bench-{name}"]) for name, overrides in VARIANTS.items()
    }
    return configs, max_new_tokens


def model_flops(config: RunConfig) -> dict:
    """What the runs' model FLOPs rest on (`config` resolved): the model's matmul parameters N (None where
    `workers.flops` cannot count them) and one core's matmul ceiling in the dtype the runs compute in (0 off a
    CPU, as the trainer's: one small product says nothing of a GPU's peak); its shape, for the counts."""
    import torch

    shape = json.loads((Path(config.model.path) / "config.json").read_text())
    shape = shape if flops.counts(shape) else None
    on_cpu = config.model.device == "cpu"
    ceiling = flops.probe_ceiling(getattr(torch, config.model.dtype))["prefill"] if on_cpu else 0.0
    return {
        "dtype": config.model.dtype,
        "ceiling_gflops_per_core": ceiling,
        "cpu_model": flops.cpu_model(),
        "matmul_parameters": flops.matmul_parameters(shape) if shape else None,
        "shape": shape,
    }


def shared_model(configs: dict[str, RunConfig], progress: bool) -> dict[str, RunConfig]:
    """The configs with one demo model, built for the task and seed, shared by every run (none if model.path is set)."""
    first = next(iter(configs.values()))
    if first.model.path:
        return configs
    task = first.data.task.replace("/", "_").replace(":", "_")  # a plug-in's path:Class makes one folder name
    where = Path(first.runs_dir) / f"models-{time.strftime('%Y%m%d-%H%M%S')}" / f"{task}-seed{first.seed}"
    path = build_demo_model(first, where, progress)
    return {name: with_model(config, path) for name, config in configs.items()}


def measure_variants(
    configs: dict[str, RunConfig], args: argparse.Namespace, model: dict, rollout_cores: int
) -> dict[str, dict] | None:
    """Each variant run to the end, with its rates, its rollout's model GFLOP/s and MFU (`model`: `model_flops`,
    on `rollout_cores`) and the cores each role used; None if one did not finish."""
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
        start, end = rates.pop("window")
        rollout = [line for line in lines if line["source"] == "rollout" and start <= line["time"] <= end]
        used = rollout_utilisation(rollout, model["shape"], model["ceiling_gflops_per_core"], rollout_cores)
        results[name] = {"run_dir": str(run_dir), **rates, **used, "cpu_cores": cpu.cores(start, end)}
        trajectories = config.trainer.steps * config.trainer.batch_groups * config.data.n_samples
        results[name]["mean_completion_tokens"] = round(results[name]["trained_tokens"] / trajectories, 1)
    return results


def run(args: argparse.Namespace) -> int:
    configs, max_new_tokens = variant_configs(args)
    configs = shared_model(configs, progress=not args.no_progress)
    config, info = configs["async"], machine()
    cores = cores_given(config, info["cpu_count"], info["usable_cores"])
    model = model_flops(resolve(config))
    print(flops_line(model), flush=True)
    results = measure_variants(configs, args, model, cores["rollout"]["processes"] * cores["rollout"]["threads"])
    if results is None:
        return 1
    report = {
        "async_over_sync": round(results["async"]["trained_tokens_per_s"] / results["sync"]["trained_tokens_per_s"], 3),
        "interrupt_on_over_off": ratio(
            results["async"]["generated_tokens_per_s"], results["async_no_interrupt"]["generated_tokens_per_s"]
        ),
        "interrupt_on_over_off_trained": round(
            results["async"]["trained_tokens_per_s"] / results["async_no_interrupt"]["trained_tokens_per_s"], 3
        ),
        "cores_given": cores,
        "cpu_bound": cpu_bound(results, info["usable_cores"]),
        "model_flops": {key: value for key, value in model.items() if key != "shape"},
        "runs": results,
        "settings": {**vars(args), **run_settings(args, config, max_new_tokens)},
        "machine": info,
    }
    print(table(report))
    out = out_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def run_settings(args: argparse.Namespace, config: RunConfig, max_new_tokens: int) -> dict:
    """What every run shared, as the report's settings say it."""
    demo = f"the {config.data.task} task's demo model ({config.model.path}), warmed up as `asyncrl run` does"
    given = f"{config.model.path}, given by --model" if args.model else f"{demo} for the seed"
    return {
        "out": str(out_path(args)),
        "steps": config.trainer.steps,
        "batch_groups": config.trainer.batch_groups,
        "n_samples": config.data.n_samples,
        "lr": config.trainer.optim.lr,
        "max_new_tokens": max_new_tokens,
        "task": config.data.task,
        "task_config": bench_task(args, DEMO_TASK),
        "template": config.data.template,
        "variants": VARIANTS,
        "model": f"{given}, shared by the three runs",
        "workload": f"the {config.data.task} task's own prompts; outputs end at the model's end token "
        "or at max_new_tokens",
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def flops_line(model: dict) -> str:
    """`model_flops` in one line: N and the ceiling per core in the runs' dtype."""
    ceiling = model["ceiling_gflops_per_core"]
    where = (
        f"ceiling {ceiling:,.1f} GFLOP/s per core in {model['dtype']} (one thread, a 512x1024 by 1024x1024 product; "
        f"{model['cpu_model'] or 'CPU model unknown'})"
        if ceiling
        else f"no ceiling measured ({model['dtype']} off a CPU): no MFU"
    )
    n = model["matmul_parameters"]
    return f"model FLOPs: N = {n:,} matmul parameters; {where}" if n else f"model FLOPs: not counted; {where}"


def utilisation_lines(report: dict) -> list[str]:
    """Each run's rollout and trainer model GFLOP/s and MFU."""
    rollout = report["cores_given"]["rollout"]

    def rate(gflops: float | None, mfu: float | None) -> str:
        return (
            "not measured"
            if gflops is None
            else f"{gflops:,.2f} GFLOP/s" + (f" (MFU {mfu:.2%})" if mfu is not None else "")
        )

    lines = [
        flops_line(report["model_flops"]),
        f"  rollout: 2N a generated token over the window, MFU over its {rollout['processes'] * rollout['threads']} "
        "core(s); trainer: its forwards' and backwards' fb_gflops and fb_mfu, means over the measured steps",
    ]
    for name, r in report["runs"].items():
        lines.append(
            f"  {name}: rollout {rate(r['rollout_gflops'], r['rollout_mfu'])}, "
            f"trainer {rate(r['fb_gflops'], r['fb_mfu'])}"
        )
    return lines


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
    lines += utilisation_lines(report)
    lines.append(f"async/sync effective training throughput: {times(report['async_over_sync'])}")
    lines.append(
        f"interruption on/off generation throughput: {times(report['interrupt_on_over_off'])} "
        f"(training throughput {times(report['interrupt_on_over_off_trained'])})"
    )
    return "\n".join(lines)
