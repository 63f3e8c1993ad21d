"""`asyncrl eval`: the evaluator (`workers.evaluator.scoring`) on a model directory or on a run's weight version.

What is unknown from the flags comes from the run (`--run DIR`: its config.yaml): data, reward,
template, lengths, device. A run's version, whole or delta (rebuilt from its chain of deltas), is
refused unless it is intact: its sha256 must match the run's `weights` announcement when the run's
topics export is at hand, and in any case its file must read as safetensors and name its own version
(a delta's result must hash as its header says).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ConfigError, load_config
from pipeline.model_cache import model_path, model_width
from schemas.config import DataConfig, RewardConfig, RunConfig
from workers.cores import auto_dtype
from workers.evaluator import humaneval
from workers.evaluator.rows import file_rows, task_rows
from workers.evaluator.scoring import EvalSettings, Evaluator, RewardCalls, eval_reward, write_rows
from workers.rows import Row
from workers.weights import WeightsError

DEFAULT_MAX_NEW_TOKENS = 512  # a dataset file with no run and no task: long enough for short reasoning
HEADLINE = ("pass_at_1", "pass_at_k", "maj_at_k", "greedy_accuracy", "k", "n")


@dataclass(frozen=True)
class Target:
    """What to evaluate: a model directory, and the weight version file to load into it (None: as saved)."""

    model: str
    version: int | None = None
    weights: Path | None = None


def run_eval(args: argparse.Namespace) -> int:
    """The command: 0 when it evaluated, 2 for unusable input (ConfigError, raised to the CLI), 1 for bad weights."""
    started = time.time()
    run = run_config(args.run) if args.run else None
    if args.version is not None and run is None:
        raise ConfigError("--version needs --run DIR (a model directory has one version)")
    try:
        target = run_target(Path(args.run), run, args.version or "latest") if run else Target(model_dir(args.model))
        loaded = read_checked(target, Path(args.run)) if target.weights else None
    except WeightsError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 1
    rows, data = eval_rows(args, run)
    task = args.task or (run.data.task if run else "arith")
    reward = args.reward or default_reward(args, run)
    settings = eval_settings(args, run, task, reward)
    device, dtype = device_and_dtype(args, run)
    set_threads(args.threads or (run.rollout.threads if run else 1))
    scorer = RewardCalls(reward, task, run.reward if run else RewardConfig())  # as the run's reward worker calls it
    evaluator = build_evaluator(target, loaded, rows, scorer, settings, device, dtype)
    try:
        result = asyncio.run(evaluator.evaluate(progress=not args.no_progress))
    finally:
        scorer.close()
    provenance = {
        "model": target.model,
        "run": str(Path(args.run).resolve()) if run else None,
        "version": target.version,
        "data": data,
        "reward": reward,
        "task": task if args.task or reward == "builtin" else None,  # what the rows and verifier came from, if a task
        "template": settings.template,
        "max_new_tokens": settings.max_new_tokens,
        "stop": list(settings.stop),
        "seed": settings.seed,
        "device": device,
        "dtype": dtype,
    }
    summary = {key: result.summary[key] for key in HEADLINE} | result.summary | provenance
    summary["wall_seconds"] = round(time.time() - started, 1)
    if result.summary["failed"]:
        print(f"asyncrl: evaluation given up: {result.summary['failed']}", file=sys.stderr)
    write_outputs(args, summary, result.rows)
    print(json.dumps(summary, indent=2))
    return 0


def run_config(run_dir: str) -> RunConfig:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--run {run_dir}: no config.yaml there (a run directory is runs/<name>)")
    return load_config(path)


def model_dir(given: str) -> str:
    """A model directory, or an imported model's short name (`--model smollm2`)."""
    path = model_path(given)
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"--model {path}: not a Hugging Face model directory (no config.json)")
    return path


def weights_dir(run_dir: Path, run: RunConfig) -> Path:
    """The run's weights directory as recorded, else <run dir>/weights (a run directory moved or copied)."""
    recorded = Path(run.trainer.checkpoint.weights_dir) if run.trainer.checkpoint.weights_dir else None
    return recorded if recorded is not None and recorded.is_dir() else run_dir / "weights"


def run_target(run_dir: Path, run: RunConfig, version: str) -> Target:
    """The run's model and the file of `version` ('latest', N; 0 = the base model unless a v0 file exists), whole
    or delta."""
    from workers.runtime import stored_path, stored_versions, version_path

    base = model_dir(run.model.path) if Path(run.model.path).is_dir() else None
    directory = weights_dir(run_dir, run)
    kept = stored_versions(directory)
    if version != "latest" and not version.isdigit():
        raise ConfigError(f"--version {version!r}: give a number or 'latest'")
    number = (kept[-1] if kept else 0) if version == "latest" else int(version)
    if base is None:
        raise ConfigError(f"--run {run_dir}: its model.path {run.model.path!r} is not a model directory here")
    if number == 0 and 0 not in kept:
        return Target(base, 0, None)
    if number not in kept:
        listed = ", ".join(f"v{v}" for v in kept[-8:]) or "none"
        raise ConfigError(
            f"--version {number}: no {version_path(directory, number).name} in {directory} (kept: {listed}; "
            "trainer.checkpoint.keep_versions says how many a run keeps; 0 = the base model)"
        )
    return Target(base, number, stored_path(directory, number))


def announced_hash(run_dir: Path, version: int) -> str | None:
    """The sha256 the trainer announced for `version`, from the run's topics export; None without one."""
    from schemas.messages import WeightVersion
    from schemas.validate import DecodeError, decode
    from topics.export import ExportError, load_export

    path = run_dir / "topics.export"
    if not path.is_file():
        return None
    try:
        records = load_export(path).records.get("weights", [])
    except (ExportError, OSError, ValueError):
        return None  # no usable export: the file checks below still refuse a torn file
    for record in records:
        try:
            message = decode(record.value or b"", WeightVersion)
        except DecodeError:
            continue
        if message.version == version and message.content_hash:
            return message.content_hash
    return None


def read_checked(target: Target, run_dir: Path) -> tuple[dict, dict[str, str]]:
    """The tensors and metadata of the target's version (a delta version rebuilt from its chain): the whole
    version the trainer announced (where the run's topics export says which), intact, and of that version;
    WeightsError saying why not."""
    from workers.weight_deltas import read_stored_version

    stored = read_stored_version(Path(target.weights).parent, target.version, announced_hash(run_dir, target.version))
    return stored.tensors, stored.metadata


def default_reward(args: argparse.Namespace, run: RunConfig | None) -> str:
    """'code' for HumanEval, else the run's data.reward (its evaluation's), else builtin with --task, math with
    --data."""
    if args.data == humaneval.SOURCE:
        return "code"
    if run and not args.data and not args.task:
        return eval_reward(run)
    return run.data.reward if run else ("builtin" if args.task else "math")


def eval_rows(args: argparse.Namespace, run: RunConfig | None) -> tuple[list[Row], str]:
    """The rows (the first --max-rows) and a label saying where they came from."""
    if args.data == humaneval.SOURCE or (
        run and not args.data and not args.task and run.data.eval_source == humaneval.SOURCE
    ):
        template = args.template or (run.data.template if run else "raw")
        rows = humaneval.humaneval_rows(template)
        label = f"humaneval: the {len(rows)} problems of {humaneval.PACKAGE}, {template} prompts"
    elif args.data:
        rows, label = file_rows(args.data, "--data"), args.data
    elif args.task or (run and run.data.eval_source in ("builtin", "none")):
        spec = args.task or run.data.task
        if run and not args.task and run.data.eval_source == "none":
            raise ConfigError(
                f"--run: the run trained on {run.data.source} and has no data.eval_source: give --data FILE"
            )
        seed = run.seed if run else args.seed
        held_out = args.held_out or (run.data.held_out if run else DataConfig().held_out)
        try:
            rows = task_rows(spec, seed, held_out)
        except ValueError as exc:
            raise ConfigError(f"--task {spec}: {exc}") from None
        label = f"task {spec}: held-out split (seed {seed}, {held_out} problems)"
    elif run:
        rows, label = file_rows(run.data.eval_source, "data.eval_source"), run.data.eval_source
    else:
        raise ConfigError("give --data FILE (JSONL or Parquet) or --task SPEC (its held-out split)")
    if args.max_rows < 0 or args.k < 0 or args.temperature <= 0:
        raise ConfigError("--max-rows and --k must be >= 0, --temperature > 0")
    if args.cache_mb is not None and args.cache_mb < 0:
        raise ConfigError("--cache-mb must be >= 0")
    if args.stop is not None and not all(args.stop):
        raise ConfigError("--stop needs a non-empty string")
    return (rows[: args.max_rows] if args.max_rows else rows), label


def eval_settings(args: argparse.Namespace, run: RunConfig | None, task: str, reward: str) -> EvalSettings:
    from workers.tasks import load_task

    own = args.data == humaneval.SOURCE  # HumanEval's defaults rather than the run's
    template = args.template or (run.data.template if run else "raw")
    max_new_tokens = args.max_new_tokens or (humaneval.MAX_NEW_TOKENS if own else 0)
    max_new_tokens = max_new_tokens or (run.rollout.max_new_tokens if run else 0)
    stop = args.stop if args.stop is not None else (run.rollout.stop if run and not own else ())
    if own and args.stop is None:
        stop = humaneval.STOP if template == "raw" else humaneval.CHAT_STOP
    cache_mb = humaneval.CACHE_MB if own else (run.rollout.cache_mb if run else 0)
    if not max_new_tokens and (args.task or reward == "builtin" or run):
        try:
            max_new_tokens = load_task(task).max_new_tokens
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return EvalSettings(
        k=args.k,
        temperature=args.temperature,
        max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        template=template,
        system_prompt=args.system_prompt if args.system_prompt is not None else (run.data.system_prompt if run else ""),
        seed=args.seed,
        max_batch=args.max_batch or (run.rollout.max_batch if run else 64),
        cache_mb=args.cache_mb if args.cache_mb is not None else cache_mb,
        workflow=run.rollout.workflow if run else "",
        stop=tuple(stop),
    )


def device_and_dtype(args: argparse.Namespace, run: RunConfig | None) -> tuple[str, str]:
    """--device, else the run's, else cuda when there is one; --dtype, else the run's on its device, else as
    model.dtype=auto resolves (`auto_dtype`)."""
    import torch

    device = args.device or (run.model.device if run else ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.dtype:
        return device, args.dtype
    if run and device == run.model.device and run.model.dtype != "auto":
        return device, run.model.dtype
    model = args.model or (run.model.path if run else "")
    return device, auto_dtype(device, model_width(model_path(model)) if model else 0)


def set_threads(threads: int) -> None:
    """Torch CPU threads; few by default: tiny matmuls on more threads than free cores spin (15x slower
    measured on 2 busy cores), while a large model on an idle machine gains from --threads."""
    import torch

    if threads < 1:
        raise ConfigError("--threads must be >= 1")
    torch.set_num_threads(threads)


def build_evaluator(
    target: Target,
    version: tuple[dict, dict[str, str]] | None,
    rows: list[Row],
    scorer: RewardCalls,
    settings: EvalSettings,
    device: str,
    dtype: str,
) -> Evaluator:
    from transformers import AutoTokenizer

    from workers.lora import VersionLoader
    from workers.models import load_causal_lm

    model = load_causal_lm(target.model, dtype, device)
    if version is not None:  # (tensors, metadata): a whole version, or a LoRA adapter merged into the base
        VersionLoader(model).load(*version)
    return Evaluator(model, AutoTokenizer.from_pretrained(target.model), rows, scorer, settings)


def write_outputs(args: argparse.Namespace, summary: dict, rows: list[dict]) -> None:
    """--out (the summary) and --rows-out (per row; default <out>.rows.jsonl beside --out)."""
    rows_out = Path(args.rows_out) if args.rows_out else None
    if rows_out is None and args.out:
        out = Path(args.out)
        rows_out = out.with_name(f"{out.stem}.rows.jsonl")
    summary["rows_out"] = str(rows_out) if rows_out else None
    if rows_out:
        write_rows(rows_out, rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
