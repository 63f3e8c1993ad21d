"""`asyncrl bench peer`: asyncrl against the tool a CPU user would reach for, TRL's GRPOTrainer.

One after the other, on the same cores: TRL's GRPOTrainer (single process, synchronous:
generate a batch, score it, train on it) and `asyncrl run <task>`, both from the task's demo
model as `asyncrl run` warms it for the seed (built once, so both start from identical
weights), on the task's training rows, scored by the task's verifier, with the task config's
batch (trainer.batch_groups prompts x data.n_samples samples), learning rate, output limit
(rollout.max_new_tokens), sampling, clip range and loss aggregation, for the same steps. Neither
traces (telemetry.sample_ratio=0).

Both are scored by asyncrl's own Evaluator (greedy, the task's held-out split), at step 0,
every `--eval-every` steps and at the last step. The clocks, as each system would be timed by
its user:

- the peer's starts as it loads its model and builds its trainer and stops at its last step;
  its evaluations are left out (its clock is paused during them: they run in its only process);
- asyncrl's starts when the launcher starts the workers (its `start` line, the first of
  metrics.jsonl) and a version's accuracy counts from the time the trainer reported that
  step (version 0: from the start). Its evaluations are not left out: its evaluator process runs beside the workers, on
  the cores they leave idle.

`time_to_peer_final_ratio` = asyncrl's time to reach the peer's final accuracy / the peer's
wall time (below 1: asyncrl got there sooner; null: it never did).

`--model DIR|short-name` runs both on a real model instead, with the shipped real-model config
(`smollm2-math`: wordmath, chat template, its batch, learning rate, output limit, temperature and loss
aggregation; `--steps`, `--eval-rows` shorten it). TRL loads the same directory in float32 and computes in
the dtype model.dtype=auto resolves to (bfloat16 autocast on a CPU with native bfloat16, as asyncrl's trainer),
and is given each prompt as the text that its tokenizer turns into the ids asyncrl's rollout sends. The
config's trainer.skip_uniform_groups, which TRL has no counterpart of, stays asyncrl's alone (as on arith).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import msgspec
import transformers
from tqdm import tqdm
from transformers import TrainerCallback

from pipeline.bench import bench_task, build_demo_model, machine, model_overrides, task_config, task_label
from pipeline.config import ConfigError, resolve
from pipeline.monitor import read_metrics, standing_steps
from schemas.config import RunConfig

PRECISION = {  # by whether model.dtype (resolved) is bfloat16, where GRPOConfig's bf16 is set
    True: "the peer's weights and AdamW's moments float32, its forwards and backwards under bfloat16 autocast "
    "(GRPOConfig bf16), as asyncrl's trainer; asyncrl's rollout and both systems' evaluations in bfloat16 weights",
    False: "the peer in float32 throughout; asyncrl as model.dtype says",
}
TRL_MISSING = "asyncrl bench peer needs TRL: pip install -e '.[peer]'"
# trainer.loss.aggregation -> TRL's loss_type: the same normalisation of the token losses
LOSS_TYPES = {"token_mean": "dapo", "seq_mean": "grpo", "token_sum_norm": "dr_grpo"}
# trainer.loss.advantage -> TRL's scale_rewards (TRL's GRPO has no leave-one-out baseline)
REWARD_SCALING = {"grpo": "group", "drgrpo": "none"}
# steps of both systems when --steps is not given, by task (else the task config's): TRL's run on arith as
# docs: Benchmarks measures it, twice the shipped arith config's 600 (which drops groups without advantage)
PEER_STEPS = {"arith": 1200}
DEMO_TASK = "arith"


# ---- curves and the ratio: pure functions ----


def time_to_reach(curve: list[dict], accuracy: float) -> float | None:
    """Seconds of the first point of `curve` at or above `accuracy`; None if none is."""
    return next((point["seconds"] for point in curve if point["accuracy"] >= accuracy), None)


def time_to_peer_final_ratio(curve: list[dict], peer_final: float, peer_seconds: float) -> float | None:
    """asyncrl's seconds to the peer's final accuracy over the peer's seconds; None when asyncrl never got there."""
    reached = time_to_reach(curve, peer_final)
    return None if reached is None else reached / peer_seconds


def asyncrl_curve(lines: list[dict]) -> list[dict]:
    """Held-out accuracy per evaluated version from a run's metrics.jsonl lines, timed from the first line (the
    launcher's `start`, written as the workers start) to the trainer's line of that step (version 0: 0 s)."""
    start = min(line["time"] for line in lines)
    reported = {line["step"]: line["time"] for line in standing_steps(lines)}
    evals = {line["version"]: line["heldout_accuracy"] for line in lines if line["source"] == "eval"}
    return [
        {"step": version, "seconds": round(reported.get(version, start) - start, 2), "accuracy": accuracy}
        for version, accuracy in sorted(evals.items())
        if version == 0 or version in reported
    ]


# ---- the peer: TRL's GRPOTrainer ----


def grpo_settings(config: RunConfig, eval_every: int, out_dir: Path) -> dict:
    """GRPOConfig's arguments for a resolved run config: what asyncrl's trainer and rollout do, in TRL's terms."""
    loss, optim = config.trainer.loss, config.trainer.optim
    if loss.advantage not in REWARD_SCALING or optim.minibatches != 1:
        raise ConfigError(
            "bench peer: TRL's GRPOTrainer has no trainer.loss.advantage=rloo nor trainer.optim.minibatches > 1"
        )
    return {
        "output_dir": str(out_dir),
        "max_steps": config.trainer.steps,
        "per_device_train_batch_size": config.trainer.batch_groups * config.data.n_samples,
        "gradient_accumulation_steps": 1,
        "num_generations": config.data.n_samples,
        "max_completion_length": config.rollout.max_new_tokens,
        "temperature": config.rollout.temperature,
        "top_p": config.rollout.top_p,
        "top_k": config.rollout.top_k,
        "learning_rate": optim.lr,
        "lr_scheduler_type": "constant",  # asyncrl's lr is constant; TrainingArguments' default decays it
        "optim": "adamw_torch",
        "weight_decay": optim.weight_decay,
        "max_grad_norm": optim.grad_clip,
        "num_iterations": 1,
        "epsilon": loss.clip_eps,
        "epsilon_high": loss.clip_eps_high,
        "beta": loss.kl_coef,
        "loss_type": LOSS_TYPES[loss.aggregation],
        "scale_rewards": REWARD_SCALING[loss.advantage],
        "seed": config.seed,
        "data_seed": config.seed,
        "use_cpu": config.model.device == "cpu",
        "bf16": config.model.dtype == "bfloat16",  # float32 weights, bfloat16 compute: asyncrl's trainer too
        "gradient_checkpointing": False,  # TRL's default trades speed for memory this tiny model does not need
        "logging_steps": eval_every,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


class PausableClock:
    """Wall and CPU seconds since start less the time paused: the peer's evaluations are not its training."""

    def __init__(self) -> None:
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.paused = self.cpu_paused = 0.0

    def seconds(self) -> float:
        return time.perf_counter() - self.started - self.paused

    def cpu_seconds(self) -> float:
        return time.process_time() - self.cpu_started - self.cpu_paused

    @contextlib.contextmanager
    def pause(self):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - wall
            self.cpu_paused += time.process_time() - cpu


class Verifier:
    """TRL's reward function: the run's verifier on each completion (by its row's index); counts the completion
    tokens it is given, which are the tokens trained."""

    __name__ = "verifier"  # TRL names its reward metrics after it

    def __init__(self, rows: list, scorer) -> None:
        self.rows, self.score, self.tokens = rows, scorer, 0

    def __call__(self, prompts: list, completions: list[str], completion_ids: list, row: list[int], **_) -> list:
        self.tokens += sum(map(len, completion_ids))
        return [self.score(self.rows[i], text)[0] for i, text in zip(row, completions, strict=True)]


class Evaluations(TrainerCallback):
    """Held-out accuracy at step 0, every `every` steps and at the last, with the clock paused meanwhile:
    the trained weights copied into the Evaluator's own model, which asyncrl's launcher uses the same way."""

    def __init__(self, evaluator, clock: PausableClock, every: int, bar: tqdm) -> None:
        self.evaluator, self.clock, self.every, self.bar = evaluator, clock, every, bar
        self.curve: list[dict] = []
        self.first_step_seconds = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        self.measure(0, model)

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self.bar.update(1)
        if state.global_step == 1:
            self.first_step_seconds = round(self.clock.seconds(), 2)
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self.measure(state.global_step, model)

    def measure(self, step: int, model) -> None:
        from workers.weights import load_into

        seconds = self.clock.seconds()
        with self.clock.pause():
            load_into(self.evaluator.model, model.state_dict())
            accuracy = self.evaluator.accuracy()
        self.curve.append({"step": step, "seconds": round(seconds, 2), "accuracy": accuracy})
        self.bar.set_postfix(acc=f"{accuracy:.3f}", refresh=False)


def run_peer(config: RunConfig, threads: int, eval_every: int, out_dir: Path, progress: bool) -> dict:
    """TRL's GRPOTrainer on the task's training rows from `config`'s model (resolved, model.path set), on
    `threads` torch threads: its curve, wall and CPU seconds (evaluations left out) and trained tokens."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from workers.evaluator.scoring import Evaluator, make_scorer
    from workers.models import load_causal_lm

    train_rows = task_rows_for_training(config)
    evaluator = Evaluator.for_config(config)  # the rows and settings asyncrl's launcher evaluates with
    torch.set_num_threads(threads)  # after the Evaluator, which sets a rollout worker's threads
    verifier = Verifier(train_rows, make_scorer(config.data.reward, config.data.task))
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    prompts = rollout_prompts(tokenizer, train_rows, config.data.template, config.data.system_prompt)
    dataset = Dataset.from_list(
        [{"prompt": text, "row": row.index} for row, text in zip(train_rows, prompts, strict=True)]
    )
    bar = tqdm(total=config.trainer.steps, desc="trl grpo", unit="step", disable=not progress, file=sys.stderr)
    clock = PausableClock()
    model = load_causal_lm(config.model.path, "float32", config.model.device)
    evaluations = Evaluations(evaluator, clock, eval_every, bar)
    with warnings.catch_warnings():  # TRL 1.16 still sets transformers 5's deprecated gradient_checkpointing
        warnings.filterwarnings("ignore", ".*gradient_checkpointing.*", FutureWarning)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=verifier,
            args=GRPOConfig(**grpo_settings(config, eval_every, out_dir)),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[evaluations],
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log dict; the bar and the table say what counts
        trainer.train()
    bar.close()
    seconds = evaluations.curve[-1]["seconds"]  # its last step, as asyncrl's time is its trainer's last step
    steps, first = trainer.state.global_step, evaluations.first_step_seconds
    logged = [line for line in trainer.state.log_history if "loss" in line]  # its own metrics, every eval_every steps
    return measured(
        evaluations.curve, seconds, clock.cpu_seconds(), steps, verifier.tokens, first_step_seconds=first, log=logged
    )


def rollout_prompts(tokenizer, rows: list, template: str, system_prompt: str) -> list[str]:
    """Each row's prompt as TRL is given it: the text that TRL's tokenizer call turns into the token ids asyncrl's
    rollout sends (`encode_prompt`): the row's text ('raw'), or the chat template's turns decoded ('chat').
    A ConfigError where a text does not tokenize back to those ids: the two would train on different prompts."""
    from workers.models import encode_prompt

    texts = []
    for row in rows:
        ids = encode_prompt(tokenizer, row.prompt, template, system_prompt)
        text = row.prompt if template == "raw" else tokenizer.decode(ids)
        if tokenizer(text)["input_ids"] != ids:
            raise ConfigError(f"bench peer: row {row.index}'s {template} prompt does not tokenize back to its ids")
        texts.append(text)
    return texts


def task_rows_for_training(config: RunConfig) -> list:
    """The task's training split, as the run's prompt source reads it (same seed and held-out size)."""
    from workers.rows import rows_of
    from workers.tasks import load_task

    return rows_of(load_task(config.data.task).split(config.seed, config.data.held_out)[0])


def measured(curve: list[dict], seconds: float, cpu_seconds: float | None, steps: int, tokens: int, **extra) -> dict:
    """One system's row of the report."""
    return {
        "base_accuracy": curve[0]["accuracy"],
        "final_accuracy": curve[-1]["accuracy"],
        "wall_seconds": round(seconds, 2),
        "steps": steps,
        "steps_per_s": round(steps / seconds, 3),
        "trained_tokens": tokens,
        "trained_tokens_per_s": round(tokens / seconds, 1),
        "cpu_seconds": None if cpu_seconds is None else round(cpu_seconds, 1),
        **extra,
        "curve": curve,
    }


# ---- asyncrl ----


def run_asyncrl(task: str, overrides: list[str], runs_dir: Path, progress: bool) -> dict | None:
    """`asyncrl run <task> <overrides>` (which put the run under `runs_dir`) as a subprocess: its curve and rates
    from its run directory, and the CPU seconds of its processes (all of them: launcher, broker, workers, its
    evaluations); None if it failed."""
    import resource

    command = [sys.executable, "-m", "pipeline.cli", "run", task, *overrides]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = subprocess.run([*command, *([] if progress else ["--no-progress"])], stdout=subprocess.DEVNULL).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        return None
    run_dir = (runs_dir / "latest").resolve()
    lines, _ = read_metrics(run_dir / "metrics.jsonl")
    curve, steps = asyncrl_curve(lines), standing_steps(lines)
    first_step = steps[0]["time"] - min(line["time"] for line in lines)  # start-up: processes, imports, models
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    summary = json.loads((run_dir / "summary.json").read_text())
    return measured(
        curve,
        curve[-1]["seconds"],
        cpu,
        steps[-1]["step"],
        steps[-1]["trained_tokens"],
        first_step_seconds=round(first_step, 2),
        run_dir=str(run_dir),
        run_wall_seconds=summary["wall_seconds"],  # the whole command: broker, checks, evaluations, report
        interrupted_trajectories=summary["interrupted_trajectories"],
    )


# ---- the bench ----


def use_cores(threads: int | None) -> list[int]:
    """The cores both systems get: the first `threads` of the usable ones (all by default); this process and
    every process it starts are pinned to them."""
    usable = sorted(os.sched_getaffinity(0))
    count = len(usable) if threads is None else threads
    if not 1 <= count <= len(usable):
        raise ConfigError(f"--threads {threads}: this process may use {len(usable)} cores")
    os.sched_setaffinity(0, usable[:count])
    return usable[:count]


def shared_overrides(args: argparse.Namespace, runs_dir: Path) -> list[str]:
    """The task config's changes both systems see; no wall-time limit: both train every step."""
    steps = args.steps or PEER_STEPS.get(task_label(bench_task(args, DEMO_TASK)))
    steps = [f"trainer.steps={steps}"] if steps else []
    common = [*model_overrides(args), "max_wall_s=0", *args.overrides, *steps]
    return [*common, f"seed={args.seed}", "telemetry.sample_ratio=0", f"runs_dir={runs_dir}"]


def run(args: argparse.Namespace) -> int:
    try:
        import trl
    except ImportError:
        print(TRL_MISSING, file=sys.stderr)
        return 2
    transformers.utils.logging.disable_progress_bar()  # loading and saving bars would break the bench's bars
    task = bench_task(args, DEMO_TASK)
    out = Path(args.out or f"runs/bench/peer-{task_label(task)}.json")
    runs_dir = (out.parent / "peer-runs").resolve()
    common = shared_overrides(args, runs_dir)
    config = task_config(task, common)
    if config.data.source != "builtin":
        raise ConfigError("bench peer trains on a task's own rows: data.source must be builtin")
    eval_every = args.eval_every or config.eval.every or config.trainer.steps
    common.append(f"eval.every={eval_every}")
    cores = use_cores(args.threads)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if not args.model:  # the task's demo model, built once: both start from identical weights
        model = build_demo_model(config, runs_dir / f"models-{stamp}" / task_label(task), not args.no_progress)
        common.append(f"model.path={model}")
    config = resolve(task_config(task, common))
    grpo_settings(config, eval_every, runs_dir)  # an unsupported setting fails before either system runs
    print(f"bench peer on {config.data.task}: TRL {trl.__version__} GRPOTrainer, then asyncrl run", flush=True)
    peer = run_peer(config, len(cores), eval_every, runs_dir / f"trl-{stamp}", not args.no_progress)
    ours = run_asyncrl(task, [*common, f"name=peer-{task_label(task)}"], runs_dir, not args.no_progress)
    if ours is None:
        print("asyncrl: the asyncrl run did not finish", file=sys.stderr)
        return 1
    report = build_report(args, config, peer, ours, cores, eval_every, trl.__version__)
    write(report, out)
    return 0


def build_report(
    args: argparse.Namespace, config: RunConfig, peer: dict, ours: dict, cores: list[int], eval_every: int, trl: str
) -> dict:
    ratio = time_to_peer_final_ratio(ours["curve"], peer["final_accuracy"], peer["wall_seconds"])
    return {
        "time_to_peer_final_ratio": None if ratio is None else round(ratio, 3),
        "asyncrl_seconds_to_peer_final": time_to_reach(ours["curve"], peer["final_accuracy"]),
        "asyncrl": ours,
        "peer": {"system": f"TRL {trl} GRPOTrainer", **peer},
        "settings": {
            "task": config.data.task,
            "task_config": bench_task(args, DEMO_TASK),
            "template": config.data.template,
            "steps": config.trainer.steps,
            "seed": config.seed,
            "batch_groups": config.trainer.batch_groups,
            "n_samples": config.data.n_samples,
            "lr": config.trainer.optim.lr,
            "max_new_tokens": config.rollout.max_new_tokens,
            "eval_every": eval_every,
            "cores": cores,
            "model": config.model.path,
            "dtype": config.model.dtype,
            "precision": PRECISION[config.model.dtype == "bfloat16"],
            "eval_rows": min(config.eval.max_rows or config.data.held_out, config.data.held_out),
            "grpo_config": grpo_settings(config, eval_every, Path("-")) | {"output_dir": None},
            "clocks": "peer: from model load to its last step, its evaluations left out; asyncrl: from the "
            "workers' start to the trainer's report of each evaluated step, its evaluations running beside it",
            "config": msgspec.to_builtins(config),
        },
        "machine": machine(),
    }


def table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"{s['task']}: {s['steps']} steps of {s['batch_groups']} x {s['n_samples']} samples, lr {s['lr']:g}, "
        f"outputs up to {s['max_new_tokens']} tokens, seed {s['seed']}, {len(s['cores'])} core(s); held-out greedy "
        f"accuracy every {s['eval_every']} steps on {s['eval_rows']} held-out rows",
        f"model {s['model']} in {s['dtype']}, {s['template']} prompts",
        f"{'system':<24} {'base %':>7} {'final %':>8} {'wall s':>8} {'1st step s':>10} {'steps/s':>8} "
        f"{'trained tok/s':>13} {'CPU s':>8}",
    ]
    for name, r in (("asyncrl run", report["asyncrl"]), (report["peer"]["system"], report["peer"])):
        lines.append(
            f"{name:<24} {r['base_accuracy'] * 100:>7.1f} {r['final_accuracy'] * 100:>8.1f} {r['wall_seconds']:>8.1f} "
            f"{r['first_step_seconds']:>10.1f} {r['steps_per_s']:>8.3f} {r['trained_tokens_per_s']:>13.1f} "
            f"{r['cpu_seconds'] or 0:>8.1f}"
        )
    ratio, peer = report["time_to_peer_final_ratio"], report["peer"]
    final, reached = peer["final_accuracy"] * 100, report["asyncrl_seconds_to_peer_final"]
    lines.append(
        f"time_to_peer_final_ratio: {ratio} (asyncrl reached the peer's final {final:.1f} % at {reached} s; "
        f"the peer trained {peer['wall_seconds']:.1f} s)"
        if ratio is not None
        else f"time_to_peer_final_ratio: null (asyncrl never reached the peer's final {final:.1f} %)"
    )
    if peer["final_accuracy"] <= peer["base_accuracy"]:
        lines.append("the peer ended at or below the base accuracy: the ratio says nothing about learning")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Held-out accuracy against wall seconds, both systems; the peer's final accuracy as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, r in (("asyncrl run", report["asyncrl"]), (report["peer"]["system"], report["peer"])):
        ax.plot([p["seconds"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], marker="o", label=name)
    ax.axhline(report["peer"]["final_accuracy"], color="grey", linestyle="--", linewidth=1, label="peer's final")
    s = report["settings"]
    ax.set_title(f"{s['task']}: held-out greedy accuracy vs wall time, {len(s['cores'])} core(s)")
    ax.set_xlabel("wall seconds (peer: evaluations left out)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
