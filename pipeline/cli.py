"""The `asyncrl` command. Parsing imports nothing heavy, so `--help` is instant."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas.config import RunConfig

ROLES = ("prompts", "rollout", "reward", "trainer", "eval")  # eval: the launcher starts it beside the others


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Fully asynchronous RL for LLM reasoning on Kafka.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a whole pipeline locally (the built-in demo with no config)")
    run.add_argument(
        "config", nargs="?", help="YAML run config, or a shipped one by name: arith (the default, the demo), chain"
    )
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.optim.lr=1e-4")
    run.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, start nothing")
    run.add_argument("--explain", action="store_true", help="with --dry-run: list every field with its description")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    run.add_argument("--in-process", action="store_true", help="every role in this process, to read or debug")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped, failed or killed run from its last checkpoint, with its own config.yaml "
        "(every step trained once across the stop)",
    )

    prepare = commands.add_parser("prepare", help="make the model, topics and runs/<name>/config.yaml for a deployment")
    prepare.add_argument("config", nargs="?", help="YAML run config or a shipped one's name (default: arith)")
    prepare.add_argument("overrides", nargs="*", help="dotted overrides; broker.bootstrap is required")

    worker = commands.add_parser("worker", help="run one worker process (what compose and Slurm start)")
    worker.add_argument("role", choices=ROLES)
    worker.add_argument("--config", required=True, help="the resolved run config (runs/<name>/config.yaml)")
    worker.add_argument("overrides", nargs="*", help="dotted overrides")

    broker = commands.add_parser("broker", help="run the embedded Kafka-protocol broker in the foreground")
    broker.add_argument("--port", type=int, default=None, help="loopback port (default: a free one)")
    broker.add_argument("--log", default="broker.log", help="broker log file")

    add_eval_parser(commands)
    add_export_parser(commands)
    add_topics_parser(commands)
    add_replay_parser(commands)
    add_bench_parser(commands)
    add_gpu_check_parser(commands)
    from pipeline.chaos.cli import add_parser as add_chaos_parser  # the standard library only
    from pipeline.slurm import add_parser as add_slurm_parser  # the standard library only

    add_slurm_parser(commands)
    add_chaos_parser(commands)
    return parser


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """`asyncrl bench <name>` runs pipeline/bench/<name>.py; its options are declared here, so --help stays light."""
    bench = commands.add_parser("bench", help="measure the system's parts against baselines")
    kinds = bench.add_subparsers(dest="bench", required=True)
    generate = kinds.add_parser("generate", help="engine tokens/s vs Hugging Face generate at equal concurrency")
    add_generate_arguments(generate)
    microbatch = kinds.add_parser(
        "microbatch", help="trainer tokens/s and peak memory: token-budget vs fixed-count micro-batches"
    )
    add_microbatch_arguments(microbatch)
    pipeline = kinds.add_parser(
        "pipeline",
        help="training throughput: eta=0 vs eta=4, interruption on vs off",
        description="Three whole pipelines of --task's shipped config (default chain), back to back on one demo "
        "model: eta 0 (sync), eta 4 with interruption, eta 4 without. Reports trained and generated tokens/s, "
        "the cores each role was given and used, and the machine's cores.",
    )
    add_pipeline_arguments(pipeline)
    staleness = kinds.add_parser(
        "staleness",
        help="held-out accuracy vs staleness bound eta, naive vs decoupled PPO (the paper's Table 2)",
        description="Train --task (its shipped config, default chain) with eta in {0, 1, 2, 4, 8} under naive and "
        "decoupled PPO, one whole pipeline per run, from one warm-up model per seed; each cell is the mean +- "
        "sample sd over the seeds. The full grid is 5 x 2 x 3 seeds = 30 runs of the task's trainer.steps "
        "(arith: 1,200 steps, about 3 h on 2 idle CPU cores, 4-6 h on busy ones; chain: to be measured). "
        "--quick: eta 0 and 4, one seed, half the steps, 4 runs (arith: about 15 min idle, 21 min on 2 busy cores).",
    )
    add_staleness_arguments(staleness)
    add_peer_arguments(
        kinds.add_parser(
            "peer",
            help="held-out accuracy vs wall time: asyncrl run against TRL's GRPOTrainer (the peer extra)",
            description="TRL's GRPOTrainer, then `asyncrl run --task`, one after the other on the same cores, from "
            "the same demo model, with the task config's batch, samples, lr and output limit; both scored by "
            "asyncrl's evaluator. Reports each one's accuracy against wall time and time_to_peer_final_ratio "
            "(asyncrl's time to the peer's final accuracy / the peer's wall time). Needs pip install -e '.[peer]'.",
        )
    )
    add_sandbox_arguments(
        kinds.add_parser(
            "sandbox",
            help="sandboxed executions of untrusted Python per second, cold (a bwrap each) and warm",
            description="Runs `pass` and a small checker in workers/reward/sandbox.py's sandbox, cold (a fresh "
            "bwrap per execution) and warm (a fork of a warm server in fresh namespaces), --executions times at "
            "each --parallelism, and the same Python alone outside it for scale; needs bwrap (package bubblewrap).",
        )
    )


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. rollout.max_batch=16")
    add_task_argument(parser)
    parser.add_argument("--out", help="JSON results file (default: runs/bench/pipeline-<task>.json)")
    parser.add_argument("--steps", type=int, default=60, help="trainer steps per run (default: %(default)s)")
    parser.add_argument(
        "--warmup-steps", type=int, default=10, help="steps left out of the measurement (default: %(default)s)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help="output length limit (default: the task config's rollout.max_new_tokens, 0 = the task's own)",
    )
    parser.add_argument("--batch-groups", type=int, default=8, help="groups per step (default: %(default)s)")
    parser.add_argument("--n-samples", type=int, default=8, help="samples per group (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-9,
        help="trainer learning rate; tiny by default, so the policy (and its output lengths) stays "
        "the same in every run and the ratios measure the system, not learning (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the task config, for both systems")
    add_task_argument(parser, default="arith")
    parser.add_argument(
        "--steps",
        type=int,
        help="trainer steps of each (default: 1,200 on arith, TRL's run in the README, which needs them to learn "
        "what asyncrl's shipped arith config learns in 600; else the task config's trainer.steps)",
    )
    parser.add_argument("--seed", type=int, default=0, help="demo model, data order and sampling (default: 0)")
    parser.add_argument(
        "--threads", type=int, help="cores both systems are pinned to, the peer's torch threads (default: all usable)"
    )
    parser.add_argument(
        "--eval-every", type=int, help="steps between held-out evaluations (default: the task config's eval.every)"
    )
    parser.add_argument("--out", help="JSON results file, the plot next to it (default: runs/bench/peer-<task>.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_gpu_check_parser(commands: argparse._SubParsersAction) -> None:
    """`asyncrl gpu-check` (`make gpu-check`): pipeline/bench/gpu.py; without CUDA it says so and runs nothing
    (`--rehearse` runs the same checks on the CPU at toy sizes)."""
    gpu = commands.add_parser(
        "gpu-check",
        help="on a CUDA machine: the checks and benchmarks only a GPU can answer (README, GPU check)",
        description="Engine vs HF generate in bfloat16, bench pipeline with a ~100M-parameter model, packed "
        "attention on the GPU (SDPA per sequence and FlexAttention) against the CPU path, trainer steps over NCCL "
        "on one and two ranks, bench microbatch on cuda. A failing check does not stop the others; a summary "
        "table ends the output and the JSON is rewritten after each check. Exit 2 without CUDA, 1 if a check "
        "failed. --rehearse runs every check on the CPU at toy sizes (about 2 minutes on 2 cores), to find what "
        "would fail before a GPU's minutes are spent on it.",
    )
    gpu.add_argument(
        "--out",
        help="JSON results file, rewritten after each check; the checks' own files go in its folder "
        "(default: runs/bench/gpu-check.json; --rehearse: runs/bench/gpu-rehearsal.json, files in a folder of its "
        "name beside it, runs/bench/gpu-rehearsal/)",
    )
    gpu.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks (names as in the table)")
    gpu.add_argument(
        "--rehearse", action="store_true", help="run the checks on the CPU at toy sizes: no CUDA needed, no GPU numbers"
    )


def add_sandbox_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--executions", type=int, default=200, help="per program and parallelism (default: %(default)s)"
    )
    parser.add_argument(
        "--parallelism", type=int, nargs="+", default=[1, 2], help="executions at a time, threads (default: 1 2)"
    )
    parser.add_argument("--out", default="runs/bench/sandbox.json", help="JSON results file (default: %(default)s)")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/bench/generate.json", help="JSON results file (default: %(default)s)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=64,
        help="engine max_batch, and HF batch size unless --hf-batch (default: %(default)s)",
    )
    parser.add_argument(
        "--requests", type=int, default=256, help="requests per length distribution (default: %(default)s)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=96,
        help="the longest output; every fixed-length request is this long (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="weights, prompts, lengths and sampling (default: %(default)s)"
    )
    parser.add_argument("--hf-batch", type=int, default=None, help="HF generate batch size (default: --concurrency)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; more only pays on an idle machine, tiny matmuls lose under contention "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternating runs per system and length distribution; the fastest counts (default: %(default)s)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the model's weights and activations, in both systems (default: %(default)s)",
    )


def add_staleness_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. trainer.optim.lr=3e-4")
    add_task_argument(parser)
    parser.add_argument("--quick", action="store_true", help="eta 0 and 4 only, seed 0, half the steps")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds (default: 0 1 2; --quick: 0)")
    parser.add_argument(
        "--etas",
        type=int,
        nargs="+",
        help="max_staleness values (default: 0 1 2 4 8; --quick: 0 4); part of a grid, to --merge with the rest",
    )
    parser.add_argument(
        "--steps", type=int, help="trainer steps per run (default: the task config's trainer.steps; --quick: half)"
    )
    parser.add_argument(
        "--eval-every", type=int, default=50, help="steps between held-out evaluations (default: %(default)s)"
    )
    parser.add_argument(
        "--out",
        help="JSON results file, the plot next to it as .png "
        "(default: runs/bench/staleness-<task>.json; --quick: runs/bench/staleness-<task>-quick.json)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="run nothing: one table and plot from reports of separate runs (e.g. one seed each)",
    )


def add_task_argument(parser: argparse.ArgumentParser, default: str = "chain") -> None:
    parser.add_argument(
        "--task",
        default=default,
        help="a shipped config's name (pipeline/configs/<task>.yaml: arith, chain) or a YAML config file; "
        "every run is that config plus the bench's settings (default: %(default)s)",
    )


def add_microbatch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/bench/microbatch.json", help="JSON results file (default: %(default)s)")
    parser.add_argument("--sequences", type=int, default=32, help="sequences per step (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps per run, after one warm-up (default: %(default)s)"
    )
    parser.add_argument(
        "--max-length", type=int, default=512, help="longest sequence, prompt + completion (default: %(default)s)"
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=1024,
        help="tokens per dynamic micro-batch; the fixed count is chosen to stay within it (default: %(default)s)",
    )
    parser.add_argument("--hidden-size", type=int, default=256, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="model depth (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="(default: %(default)s)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="alternating runs per mode, each in a fresh process; the fastest counts (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights, lengths and tokens (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the forwards' compute dtype (autocast; float32 master weights either way) (default: %(default)s)",
    )


def add_eval_parser(commands: argparse._SubParsersAction) -> None:
    """`asyncrl eval`: its options here, its body in pipeline/eval_command.py (torch is imported only there)."""
    evaluate = commands.add_parser(
        "eval",
        help="score a model or a run's weight version on a dataset: greedy accuracy, pass@1, pass@k, maj@k",
        description="Greedy completions (and --k samples at --temperature) for every row of --data or a task's "
        "held-out split, scored by the reward's verifier. Prints the summary JSON (pass_at_1, pass_at_k, maj_at_k, "
        "greedy_accuracy, k, n, length_p50, length_p90, ...); --out writes it, --rows-out the per-row JSONL.",
    )
    which = evaluate.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="a local Hugging Face causal LM directory")
    which.add_argument("--run", metavar="DIR", help="a run directory (runs/<run>, with its config.yaml)")
    evaluate.add_argument(
        "--version", default=None, help="with --run: a weight version N, or 'latest' (default); 0 = the base model"
    )
    data = evaluate.add_mutually_exclusive_group()
    data.add_argument("--data", metavar="FILE", help="JSONL or Parquet rows with prompt and answer fields")
    data.add_argument(
        "--task",
        metavar="SPEC",
        help="a task's held-out split (arith, chain, file.py:Class); with --run the default is the run's "
        "data.eval_source, else its task's held-out split",
    )
    evaluate.add_argument(
        "--reward",
        help="'builtin', 'math' or 'module:function' (default: the run's data.reward, else builtin with --task, "
        "math with --data)",
    )
    evaluate.add_argument("--template", choices=("raw", "chat"), help="prompt template (default: the run's, else raw)")
    evaluate.add_argument("--system-prompt", default=None, help="chat template's system turn (default: the run's)")
    evaluate.add_argument("--k", type=int, default=0, help="samples per prompt beside the greedy one (default: 0)")
    evaluate.add_argument("--temperature", type=float, default=1.0, help="of the k samples (default: 1.0)")
    evaluate.add_argument(
        "--max-new-tokens",
        type=int,
        help="completion limit (default: the run's, else the task's with --task, else 512)",
    )
    evaluate.add_argument("--max-rows", type=int, default=0, help="the first N rows only (default: all)")
    evaluate.add_argument("--held-out", type=int, help="--task: size of the held-out split (default: the run's, 200)")
    evaluate.add_argument(
        "--seed", type=int, default=0, help="sampling seed; also the task split's without --run (default: 0)"
    )
    evaluate.add_argument("--max-batch", type=int, help="sequences decoded together (default: the run's, else 64)")
    evaluate.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: the run's, else cuda when available)")
    evaluate.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="(default: by device)")
    evaluate.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: the run's rollout.threads, else 1; more pays only on idle cores)",
    )
    evaluate.add_argument("--out", metavar="FILE", help="write the summary JSON here")
    evaluate.add_argument("--rows-out", metavar="FILE", help="per-row JSONL (default: <out>.rows.jsonl with --out)")
    evaluate.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_export_parser(commands: argparse._SubParsersAction) -> None:
    """`asyncrl export`: one weight version of a run as a Hugging Face model directory (pipeline/export_model.py)."""
    export = commands.add_parser(
        "export",
        help="write a run's weight version as a Hugging Face model directory (from_pretrained loads it)",
        description="config.json, generation_config.json, model.safetensors (the version's weights, in the dtype "
        "the run published), the tokenizer of the run's model.path, and asyncrl.json (run, version, sha256).",
    )
    export.add_argument("--run", required=True, metavar="DIR", help="a run directory (runs/<run>, with config.yaml)")
    export.add_argument("--version", type=int, default=None, help="the weight version (default: the newest on disk)")
    export.add_argument("--out", required=True, metavar="DIR", help="the directory to write (new, or an export)")


def add_topics_parser(commands: argparse._SubParsersAction) -> None:
    topics = commands.add_parser(
        "topics", help="list topics with offsets and counts per partition; export or import a run's topics"
    )
    add_broker_options(topics)
    actions = topics.add_subparsers(dest="action")
    export = actions.add_parser("export", help="write every topic of a run to one file")
    add_broker_options(export, inherited=True)
    export.add_argument("--out", required=True, help="the file to write")
    load = actions.add_parser("import", help="load an export into a broker (empty topics, same partitions and offsets)")
    load.add_argument("file", help="a file written by `asyncrl topics export`")
    add_broker_options(load, inherited=True)


def add_replay_parser(commands: argparse._SubParsersAction) -> None:
    replay = commands.add_parser("replay", help="decode and show what a run's topics recorded")
    kinds = replay.add_subparsers(dest="what", required=True, metavar="{tail,trajectory,step,rescore,retrain}")
    tail = kinds.add_parser("tail", help="decode and print the messages of one topic")
    tail.add_argument(
        "topic", help="a topic role (prompts, segments, scored, weights, batches, dead-letter) or its name"
    )
    tail.add_argument(
        "--id", help="only messages with this id (prompt id, trajectory id, step, version, origin) or under it"
    )
    tail.add_argument("--from-offset", type=int, default=None, help="start every partition at this offset")
    tail.add_argument("--limit", type=int, default=None, help="the last N messages (the first N with --from-offset)")
    tail.add_argument("--json", action="store_true", help="one JSON object per line, nothing cut")
    trajectory = kinds.add_parser("trajectory", help="every attempt of one trajectory, each token with its version")
    trajectory.add_argument("trajectory_id", help="<prompt id>/<sample index>")
    step = kinds.add_parser("step", help="the manifest of one step: trajectories, rewards, staleness, dropped groups")
    step.add_argument("step", type=int)
    rescore = kinds.add_parser(
        "rescore", help="score the recorded trajectories again with another reward function; show what changed"
    )
    rescore.add_argument("--reward", required=True, help="as data.reward: 'builtin', 'math' or 'module:function'")
    rescore.add_argument(
        "--processes", type=int, default=None, help="scoring processes (default: the config's reward.processes, else 1)"
    )
    rescore.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="per-call time limit in s (default: the config's reward.timeout_s, else 10)",
    )
    rescore.add_argument("--json", action="store_true", help="one JSON object: counts, mean rewards, every difference")
    retrain = kinds.add_parser(
        "retrain",
        help="train step N again from its manifest and the checkpoint before it; "
        "compare with the weights the run recorded (needs --config: checkpoints, weights)",
    )
    retrain.add_argument("--step", type=int, required=True, help="the step to rebuild")
    for kind in (tail, trajectory, step, rescore, retrain):
        add_broker_options(kind)
        kind.add_argument("--export", help="read an export file (asyncrl topics export) instead of a broker")


def add_broker_options(parser: argparse.ArgumentParser, inherited: bool = False) -> None:
    """--config/--bootstrap/--prefix; a subcommand's copy leaves its parent's values alone unless given."""
    default = argparse.SUPPRESS if inherited else None
    parser.add_argument(
        "--config", default=default, help="a run's resolved config (runs/<run>/config.yaml): broker, prefix, model"
    )
    parser.add_argument("--bootstrap", default=default, help="broker HOST:PORT (instead of the config's)")
    parser.add_argument("--prefix", default=default, help="topic prefix (instead of the config's)")


def split_config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """`asyncrl run trainer.optim.lr=1e-4` has no config file: the first word is an override."""
    if config is not None and "=" in config:
        return None, [config, *overrides]
    return config, overrides


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; overrides may also come after an option (`run --no-progress trainer.optim.lr=1e-4`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    if stray or (extra and not hasattr(args, "overrides")):  # only commands that take overrides
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # before pipeline.config: a GPU machine may lack msgspec until gpu-check installs it
    if args.command == "gpu-check":
        from pipeline.bench.gpu import main as gpu_check

        return gpu_check(args)
    from pipeline.config import RUN_DIR_NOTE, ConfigError, explain, load_config, on_one_machine, resolve, to_yaml

    try:
        if args.command in ("topics", "replay"):
            return inspect_run(args)
        if args.command == "eval":
            return eval_command(args)
        if args.command == "export":
            from pipeline.export_model import export_model

            print(export_model(args.run, args.version, args.out))
            return 0
        if args.command == "chaos":
            from pipeline.chaos.command import chaos_command

            return chaos_command(args)
        if args.command == "bench":
            from pipeline.bench import run as run_bench

            return run_bench(args)
        if args.command == "broker":
            from topics.broker import serve_forever

            serve_forever(args.port, args.log)
            return 0
        if args.command == "worker":
            from pipeline.launch import run_worker

            run_worker(args.role, args.config, args.overrides)
            return 0
        if args.command == "run" and args.resume:
            return resume_command(args)
        path, overrides = split_config_and_overrides(args.config, args.overrides)
        path = config_file(path)
        config = load_config(path, overrides)
        if args.command == "slurm":
            from pipeline.slurm import command as slurm_command

            return slurm_command(path, overrides, config, args)
        if args.command == "prepare":
            return prepare_command(config)
        if args.dry_run:
            config = resolve(on_one_machine(config))
            print(RUN_DIR_NOTE + (explain(config) if args.explain else to_yaml(config)), end="")
            return 0
        if args.in_process:
            from pipeline.in_process import run_in_process

            return run_in_process(config, progress=not args.no_progress)
        from pipeline.launch import run_pipeline

        return run_pipeline(config, progress=not args.no_progress)
    except ConfigError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2


def prepare_command(config: RunConfig) -> int:
    """`asyncrl prepare`: the model, topics and config.yaml of a deployment, on the broker its workers will use.
    A run directory with a checkpoint is a resumed deployment: a `resume` line for summary.json's resumed_from."""
    from pipeline.config import ConfigError
    from pipeline.launch import check_dataset, checkpoint_step, prepare
    from pipeline.monitor import note_start

    if not config.broker.bootstrap:
        raise ConfigError("prepare needs broker.bootstrap=HOST:PORT (the broker the workers will use)")
    check_dataset(config)
    path = prepare(config, deployment=True)[1]
    step = checkpoint_step(path.parent)
    if step is not None:
        note_start(path.parent, step)
    print(path)
    return 0


def resume_command(args: argparse.Namespace) -> int:
    """`asyncrl run --resume RUN_DIR`: the run's own config.yaml runs again, nothing given instead."""
    from pathlib import Path

    from pipeline.config import ConfigError
    from pipeline.launch import resume_pipeline

    if args.config or args.overrides or args.dry_run:
        raise ConfigError("--resume runs the run's own config.yaml: give no config, override or --dry-run with it")
    return resume_pipeline(Path(args.resume), progress=not args.no_progress)


def eval_command(args: argparse.Namespace) -> int:
    """`asyncrl eval` (pipeline/eval_command.py: torch is imported there); unusable input raises ConfigError."""
    from pipeline.eval_command import run_eval

    return run_eval(args)


def inspect_run(args: argparse.Namespace) -> int:
    """`asyncrl topics` and `asyncrl replay`: a missing topic or broker is a message, not a traceback."""
    from aiokafka.errors import KafkaError

    from pipeline.replay import replay_command, topics_command
    from topics.export import ExportError

    try:
        return topics_command(args) if args.command == "topics" else replay_command(args)
    except KafkaError as exc:
        print(
            f"asyncrl: broker error: {exc} (a finished run's embedded broker is gone; "
            "`asyncrl replay ... --export FILE` reads its export)",
            file=sys.stderr,
        )
    except (LookupError, ExportError, TimeoutError, OSError) as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
    return 1


SHIPPED_CONFIGS = "configs"  # pipeline/configs/<name>.yaml: `asyncrl run <name>`


def config_file(given: str | None) -> str:
    """A YAML path, or the name of a shipped config (`arith`, `chain`); none given = `arith`, the demo."""
    from pathlib import Path

    from pipeline.config import ConfigError

    shipped = Path(__file__).parent / SHIPPED_CONFIGS
    if given is None:
        return str(shipped / "arith.yaml")
    if Path(given).is_file() or given.endswith((".yaml", ".yml")):
        return given
    if (shipped / f"{given}.yaml").is_file():
        return str(shipped / f"{given}.yaml")
    names = ", ".join(sorted(p.stem for p in shipped.glob("*.yaml")))
    raise ConfigError(f"{given!r} is neither a config file nor a shipped config ({names})")


def run(argv: list[str] | None = None) -> int:
    """The process's entry (`asyncrl`, `python -m pipeline.cli`, a forked worker): `main`, then an exit that
    leaves what the process holds out of the interpreter's last garbage collections. They walk every object
    still tracked, torch's and transformers' imported code above all: ~1 s of each worker's and the launcher's
    exit here. Objects freed by reference counting still are; cycles are left to the process's end."""
    try:
        return main(argv)
    finally:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(run())
