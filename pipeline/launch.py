"""`asyncrl run`: one machine, one broker, one process per worker, one run directory.

The launcher starts a fork server that imports the workers' code meanwhile, starts the
embedded broker unless a bootstrap is configured, prepares the model (the demo builds and
warms up its own) and config.yaml, then forks the workers from that server, each a
process as if started as `asyncrl worker <role>` (`pipeline.forkserver`); from the
trainer's first step it starts the held-out evaluator (`pipeline.eval_worker`, on idle
cores only), follows `metrics.jsonl` for the
progress bar and asks for evaluations, and stops everything when the trainer has made its
last step, on Ctrl-C or SIGTERM, when the embedded broker dies, or after `max_wall_s`.
`asyncrl run --resume RUN_DIR` starts a stopped, failed or killed run again from its
newest checkpoint; on the embedded broker its topics come back from `topics.export`,
which the trainer appends to before each checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import msgspec

from pipeline.config import ConfigError, derived_weights_dir, load_config, on_one_machine, resolve, save_config
from pipeline.forkserver import ForkedProcess, ForkServer, reap_strays, worker_argv
from schemas.config import RunConfig
from topics.broker import die_with_parent
from workers import runtime
from workers.cores import lower_priority

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pipeline.eval_worker import EvalRequests
    from topics.broker import EmbeddedBroker

WORKER_MODULES = {
    "prompts": "workers.prompt_source",
    "rollout": "workers.rollout.worker",
    "reward": "workers.reward.worker",
    "trainer": "workers.trainer.worker",
    "eval": "pipeline.eval_worker",  # the launcher's own: the run's held-out evaluation
}
LOCK_FILE = "launcher.lock"  # in the run directory: held by the launcher running it (`run_dir_lock`)
EARLIER_LAUNCH_WAIT_S = 60.0  # for the workers of a killed launcher of the run to end (`wait_for_earlier_launch`)
STOP_ORDER = ("prompts", "rollout", "reward", "trainer")  # the trainer last: it checkpoints on stop; then the
# evaluator scores what it was asked for (`LocalRun.finish_evaluation`)
BROKER_GONE_STOP_S = 5.0  # all workers at once: without a broker nothing flows, a delivery would wait 40 s
EVAL_STALL_S = 600.0  # an evaluator that scores no queued version for this long once the workers stopped is stopped
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are processes already


def run_worker(role: str, config_path: str, overrides: list[str]) -> None:
    """The body of `asyncrl worker <role>`: run until done or SIGTERM. A bad config fails before the role's imports
    (torch and transformers: 2.5-4 CPU-seconds; a forked worker has them already)."""
    config = load_config(config_path, overrides)
    module = importlib.import_module(WORKER_MODULES[role])
    runtime.run_until_stopped(lambda stop: module.main(resolve(config), stop))


@dataclass
class WorkerProcess:
    role: str
    index: int
    config_path: Path
    log_path: Path
    ranks: int = 1  # > 1: that many processes under torchrun (the trainer's FSDP2 ranks)
    idle: bool = False  # under SCHED_IDLE from its first instruction (the evaluator)
    forks: ForkServer | None = None  # where it is forked from, already imported (`pipeline.forkserver`)
    process: subprocess.Popen | ForkedProcess | None = None
    restarts: int = 0

    def start(self) -> None:
        """Forked by the run's fork server where it has one (a trainer of several ranks never is), else started
        as `asyncrl worker ROLE` (compose and Slurm start it so too)."""
        with StopSignals.held():  # a stop while it starts is raised once it is recorded
            if self.forks is not None and self.ranks == 1:
                self.process = self.forks.fork(self.role, self.config_path, self.log_path, self.idle, StopSignals.due)
                if self.process is not None or StopSignals.due():  # none started for a run that stops
                    return
            worker = worker_argv(self.role, self.config_path)[1:]  # after the interpreter
            if self.ranks > 1:  # torchrun forwards SIGTERM to its ranks and ends them all when one fails
                worker = ["-m", "pipeline.local_torchrun", f"--nproc-per-node={self.ranks}", *worker]  # on loopback
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, *worker],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=self.before_exec,
                )

    def before_exec(self) -> None:
        """In the child: it dies with the launcher, and an idle worker computes on idle cores only."""
        die_with_parent()
        if self.idle:
            lower_priority()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it does not end in time; always reaped."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def new_run_dir(config: RunConfig) -> RunConfig:
    """A fresh name `<name>-<time>` under runs_dir (linked as `latest` only once its config.yaml is written).
    Another run's config.yaml run again names that run's weights directory: the new run gets its own. One of
    the user's choice must hold no weight versions: another run's would pass for this one's (the newest on
    disk is what `asyncrl export` and a resumed trainer take as the run's)."""
    checkpoint = config.trainer.checkpoint
    if checkpoint.weights_dir == derived_weights_dir(config):  # that run's own: derive the new run's
        checkpoint = msgspec.structs.replace(checkpoint, weights_dir="")
    elif checkpoint.weights_dir and (held := runtime.versions_on_disk(Path(checkpoint.weights_dir))):
        raise ConfigError(
            f"trainer.checkpoint.weights_dir {checkpoint.weights_dir} holds weight versions already (v{held[0]} to "
            f"v{held[-1]}, another run's): give this run an empty directory"
        )
    runs = Path(config.runs_dir).resolve()
    name = f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    while (runs / name).exists():
        name += "x"
    (runs / name).mkdir(parents=True)
    trainer = msgspec.structs.replace(config.trainer, checkpoint=checkpoint)
    return msgspec.structs.replace(config, name=name, runs_dir=str(runs), trainer=trainer)


def link_latest(run_dir: Path) -> None:
    """`<runs_dir>/latest` -> run_dir, replaced in one rename: it never names a run without its config.yaml."""
    link = run_dir.parent / f".latest-{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(run_dir.name)
    link.replace(run_dir.parent / "latest")


def check_dataset(config: RunConfig) -> None:
    """Fail before anything starts when the dataset has no usable row (bad rows alone go to dead-letter)."""
    from workers.rows import load_rows

    try:
        rows, bad = load_rows(config)
    except OSError as exc:
        raise ConfigError(f"data.source {config.data.source}: {exc.strerror}") from exc
    except ValueError as exc:  # the task's own rows: e.g. a held-out split as large as the task
        raise ConfigError(str(exc)) from None
    if not rows:
        reasons = "; ".join(str(row) for row in bad[:3])
        raise ConfigError(f"data.source {config.data.source} has no usable row{': ' + reasons if reasons else ''}")
    check_template(config)


def check_template(config: RunConfig) -> None:
    """Fail before anything starts when data.template=chat has no chat template to apply: the demo model's
    tokenizer has none, and a tokenizer without one (or whose template never opens the assistant's turn)
    would otherwise stop the prompt source only once the run is up."""
    if config.data.template != "chat":
        return
    if not config.model.path:
        raise ConfigError("data.template=chat needs model.path: the demo model's tokenizer has no chat template")
    from transformers import AutoTokenizer

    from workers.models import check_chat_template

    try:
        check_chat_template(AutoTokenizer.from_pretrained(config.model.path))
    except (OSError, ValueError) as exc:
        reason = next(iter(str(exc).splitlines()), type(exc).__name__)
        raise ConfigError(f"model.path {config.model.path}: {reason}") from None


def check_wandb(config: RunConfig) -> None:
    """Fail before anything starts when W&B is configured but wandb is not installed (it is an extra)."""
    if config.telemetry.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("telemetry.wandb_project is set but wandb is not installed: pip install 'asyncrl[wandb]'")


def prepare(config: RunConfig, progress: bool = True, deployment: bool = False) -> tuple[RunConfig, Path]:
    """Everything workers need before they start: the model (pre-flight checked), the run's key, the topics,
    `config.yaml`.

    Idempotent for deployments (compose, Slurm): a run directory that already has
    its config.yaml keeps it (and its model); the topics are ensured every time. A deployment's workers always
    join their consumer groups (`broker.sole_consumers` false), whatever the config it was prepared from says.
    Returns the resolved config and its path.
    """
    from pipeline.preflight import check_workflow, preflight
    from topics.admin import BrokerUnreachable, ensure_topics
    from workers.announce import create_key

    run_dir = Path(config.runs_dir).resolve() / config.name
    config_path = run_dir / "config.yaml"
    if config_path.exists():
        config = load_config(config_path)
    else:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        config = msgspec.structs.replace(config, runs_dir=str(run_dir.parent))
    config = resolve(config)  # the task's defaults (warm-up steps) before the demo model is built
    check_workflow(config)
    if not config.model.path:
        from pipeline.demo_model import prepare_demo_model
        from workers.rollout.workflow import load_workflow

        model_dir = prepare_demo_model(
            run_dir / "model",
            config.data.task,
            seed=config.seed,
            task_seed=config.seed,
            steps=config.model.warmup_steps,
            progress=progress,
            held_out=config.data.held_out,
            workflow=load_workflow(config.rollout.workflow),
        )
        config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=str(model_dir)))
    config = resolve(config)
    if deployment:  # its workers of a role may be scaled: each joins the role's consumer group
        config = msgspec.structs.replace(config, broker=msgspec.structs.replace(config.broker, sole_consumers=False))
    preflight(config)  # what would crash-loop the workers, as one line with the fix, before any starts
    create_key(run_dir)  # once: the trainer signs every weight announcement with it (workers.announce)
    layout = runtime.topic_layout(config)  # every time: a broker may have lost its topics
    try:  # none without a broker: the in-process run's topics are in its memory
        if config.broker.bootstrap:
            asyncio.run(ensure_topics(config.broker.bootstrap, layout.names, layout.partitions))
    except BrokerUnreachable:
        raise ConfigError(
            f"no broker answers at broker.bootstrap={config.broker.bootstrap}: start it, or leave "
            "broker.bootstrap empty for an embedded one"
        ) from None
    save_config(config, config_path)
    return config, config_path


def export_topics_quietly(config: RunConfig, run_dir: Path) -> None:
    """Append what the topics gained since the trainer's last checkpoint to `<run dir>/topics.export`, for
    replay and `--resume`; a failure costs the file's newest records, not the run."""
    from topics.export import append_export

    try:
        asyncio.run(append_export(config.broker.bootstrap, run_dir / "topics.export", config.broker.topic_prefix))
    except Exception as exc:  # the run's results are already safe; say what is missing
        print(f"asyncrl: topics not exported ({exc})", file=sys.stderr)


class RunStopped(KeyboardInterrupt):
    """Raised in the launcher's main thread wherever it is (the warm-up included; a process being started:
    once it is recorded, `StopSignals.held`) by a stop signal or the embedded broker's death, so that the run
    ends through the same cleanup as any other, without a traceback."""

    def __init__(self, outcome: str, reason: str, exit_code: int):
        super().__init__(reason)
        self.outcome, self.reason, self.exit_code = outcome, reason, exit_code


class StopSignals:
    """SIGINT and SIGTERM while `asyncrl run` runs: the first one raises RunStopped (exit code 128 + N; inside
    `held`, at the block's end). Once the cleanup has begun (`cleaning`) a signal only says so: a second Ctrl-C
    never cuts short the workers' checkpoint, the summary or the topic export. `watch` makes the broker's death
    a RunStopped too."""

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # SIGUSR1: sent by `watch`, the broker is gone
    active: ClassVar[StopSignals | None] = None  # the handlers installed now (`held` defers them)

    def __init__(self) -> None:
        self.cleaning, self.stopped, self.broker_gone, self.watcher = False, None, "", None
        self.holding, self.deferred = False, False

    def __enter__(self) -> StopSignals:
        self.previous = {signum: signal.signal(signum, self.handle) for signum in self.HANDLED}
        StopSignals.active = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        StopSignals.active = None
        if self.watcher is not None:  # ends with the broker, which the cleanup stopped: no SIGUSR1 after this
            self.watcher.join(timeout=1)
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def handle(self, signum: int, frame: object) -> None:
        if self.cleaning or self.stopped:  # os.write: print() may be mid-write in the interrupted code
            os.write(2, b"asyncrl: already stopping; waiting for the checkpoint, the summary and the topic export\n")
            return
        if signum == signal.SIGUSR1:
            self.stopped = RunStopped("failed", self.broker_gone, 1)
        else:
            self.stopped = RunStopped("stopped", f"{signal.Signals(signum).name} received", 128 + signum)
        if self.holding:
            self.deferred = True
            return
        raise self.stopped

    @classmethod
    def due(cls) -> bool:
        """A stop arrived inside `held` and waits for the block's end."""
        return cls.active is not None and cls.active.deferred

    @classmethod
    @contextlib.contextmanager
    def held(cls) -> Iterator[None]:
        """A stop that arrives inside the block is raised at its end. Raised inside Popen, it left the process
        started but unrecorded (`WorkerProcess.process` None): never stopped, and the cleanup failed on it."""
        stops = cls.active
        if stops is None or stops.holding:
            yield
            return
        stops.holding = True
        try:
            yield
        finally:
            stops.holding = False
            deferred, stops.deferred = stops.deferred, False
        if deferred:
            raise stops.stopped

    def watch(self, broker: EmbeddedBroker) -> None:
        """A thread that sends the main thread SIGUSR1 when the broker exits before the cleanup stops it."""

        def follow_broker() -> None:
            while broker.running:
                time.sleep(0.2)
            if not self.cleaning:
                tail = " | ".join(line for line in broker.log_tail().splitlines()[-3:] if line.strip())
                self.broker_gone = (
                    f"the embedded broker exited with code {broker.exit_code} ({broker.log_path}: {tail})"
                )
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

        self.watcher = threading.Thread(target=follow_broker, name="broker-watch", daemon=True)
        self.watcher.start()


def stop_at_once(workers: list[WorkerProcess], timeout_s: float) -> None:
    """SIGTERM to every worker together, SIGKILL to those still there `timeout_s` later."""
    running = [w.process for w in workers if w.process is not None and w.process.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in running:
        try:
            process.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class LocalRun:
    """What `asyncrl run` has started so far, so that whenever it stops it stops exactly that, in order."""

    config: RunConfig
    run_dir: Path
    resumed_from: int | None = None  # `--resume`: the step of the checkpoint the trainer resumes from
    broker: EmbeddedBroker | None = None
    workers: list[WorkerProcess] = field(default_factory=list)
    config_path: Path | None = None  # set once config.yaml is written
    evaluation: EvalRequests | None = None  # the evaluator process's queue; None without an evaluation set
    forks: ForkServer | None = None  # the process the workers are forked from
    metrics_offset: int = 0  # where the monitor starts reading metrics.jsonl: after a resumed run's earlier lines

    def start(self, stops: StopSignals, eval_rows: list | None, progress: bool) -> None:
        """The fork server on CPU (importing the workers' code meanwhile), the broker, the model and topics (config.yaml,
        then `latest`), the evaluator's queue, asked first for the base model (a resumed run has it in
        metrics.jsonl), then the workers (the evaluator: `start_evaluator`)."""
        from pipeline import monitor
        from pipeline.eval_set import NO_EVAL_SET
        from pipeline.eval_worker import EvalRequests

        if self.config.model.device == "cpu":  # a CUDA driver touched before a fork is unusable in the child
            self.start_fork_server(evaluates=eval_rows is not None)
        if not self.config.broker.bootstrap or self.config.broker.embedded:  # embedded: a config.yaml run again
            self.start_broker(stops)
        self.config, self.config_path = prepare(self.config, progress)
        link_latest(self.run_dir)
        self.metrics_offset = monitor.note_start(self.run_dir, self.resumed_from)
        if eval_rows is not None:
            self.evaluation = EvalRequests(self.run_dir, runtime.weights_dir(self.config), self.resumed_from)
            if self.resumed_from is None:
                self.evaluation.ask(0)
        elif self.config.eval.enabled:
            print(NO_EVAL_SET, file=sys.stderr)
        roles = ["trainer", "reward", "prompts"] + ["rollout"] * self.config.rollout.workers
        for index, role in enumerate(roles):
            ranks = self.config.trainer.ranks if role == "trainer" else 1
            log_path = self.run_dir / "logs" / f"{role}-{index}.stdout"
            self.workers.append(WorkerProcess(role, index, self.config_path, log_path, ranks, forks=self.forks))
            self.workers[-1].start()

    def start_fork_server(self, evaluates: bool) -> None:
        """The process the workers are forked from, importing their code while the launcher makes the broker,
        the model and the topics (`pipeline.forkserver`)."""
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        roles = ["reward", "prompts", "rollout"] + ["trainer"] * (self.config.trainer.ranks == 1) + ["eval"] * evaluates
        with StopSignals.held():
            self.forks = ForkServer(roles, self.run_dir / "config.yaml", logs / "forkserver.stdout")

    def start_evaluator(self) -> None:
        """The evaluator process, once the trainer has made its first step (the monitor calls this): started
        beside the workers, even under SCHED_IDLE, it delayed their start by ~5 s on 2 cores (cause not found)."""
        if self.evaluation is None:
            return
        log_path = self.run_dir / "logs" / "eval-0.stdout"
        self.workers.append(WorkerProcess("eval", 0, self.config_path, log_path, idle=True, forks=self.forks))
        self.workers[-1].start()

    def finish_evaluation(self) -> None:
        """Once the workers have stopped: the last step's version asked for, and the queue scored (every core is
        the evaluator's now) before summary.json is written; an evaluator stalled for EVAL_STALL_S is stopped."""
        from pipeline import monitor

        version = monitor.final_version(self.run_dir)
        if version is not None and not any(w.role == "eval" for w in self.workers):
            self.start_evaluator()  # the run ended before the monitor saw its first step
        evaluator = next((w for w in self.workers if w.role == "eval"), None)
        if evaluator is None or evaluator.process is None or evaluator.process.poll() is not None:  # none, or failed
            return
        if version is not None:
            self.evaluation.ask(version, wait_s=0)
        self.evaluation.close()
        pending, progress_at = self.evaluation.pending(), time.monotonic()
        if pending > 1:
            print(f"asyncrl: scoring the {pending} versions still queued for evaluation", file=sys.stderr)
        while evaluator.process.poll() is None:
            if (left := self.evaluation.pending()) < pending:
                pending, progress_at = left, time.monotonic()
            elif time.monotonic() - progress_at > EVAL_STALL_S:
                print(f"asyncrl: the evaluator scored nothing in {EVAL_STALL_S:.0f} s; stopping it", file=sys.stderr)
                evaluator.stop()
            time.sleep(0.05)

    def start_broker(self, stops: StopSignals) -> None:
        """The embedded broker on a free port. On a resume the run's topics and its groups' committed offsets
        come back from its export first, and config.yaml names the new address (prepare reads it back)."""
        from topics.broker import EmbeddedBroker

        with StopSignals.held():  # a stop inside its Popen would leave it running unrecorded
            self.broker = EmbeddedBroker(self.run_dir / "broker.log").start()
        stops.watch(self.broker)
        broker = msgspec.structs.replace(self.config.broker, bootstrap=self.broker.bootstrap, embedded=True)
        self.config = msgspec.structs.replace(self.config, broker=broker)
        if self.resumed_from is not None:
            import_run_topics(self.config)
            save_config(self.config, self.run_dir / "config.yaml")

    def stop(self) -> None:
        """The workers in STOP_ORDER (the trainer last: it checkpoints), the topics' export, then the broker."""
        if self.broker is not None and not self.broker.running:
            stop_at_once(self.workers, BROKER_GONE_STOP_S)
        try:
            for role in STOP_ORDER:
                for worker in self.workers:
                    if worker.role == role:
                        worker.stop()
            self.finish_evaluation()
        finally:  # whatever failed above, no fork server and no broker is left behind
            if self.forks is not None:
                self.forks.stop()
            if self.broker is not None:
                if self.broker.running and self.config_path:  # a dead broker took its topics with it
                    export_topics_quietly(self.config, self.run_dir)  # the broker keeps them in memory only
                self.broker.stop()
            reap_strays()  # every child of its own is reaped: the rest was adopted (a killed worker's children)


def import_run_topics(config: RunConfig) -> None:
    """A resumed run's export into its new embedded broker: every record at its offset, the groups' commits."""
    from topics.export import ExportError, import_topics

    path = runtime.topics_export_path(config)
    try:
        counts = asyncio.run(import_topics(path, config.broker.bootstrap, config.broker.topic_prefix))
    except ExportError as exc:
        raise ConfigError(f"cannot resume from {path}: {exc}") from None
    print(f"asyncrl: {sum(counts.values())} records of {path} loaded into the new broker", file=sys.stderr)


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's newest trainer checkpoint (where its trainer resumes), None before the first."""
    from workers.trainer.checkpoint import newest

    checkpoint = newest(run_dir / "checkpoints")
    return None if checkpoint is None else int(checkpoint.stem.removeprefix("step_"))


def resumable(run_dir: Path) -> tuple[RunConfig, int]:
    """The run's own config and the step of its newest checkpoint; a ConfigError (one line) when there is
    nothing to resume from."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: not a run directory, or one stopped before it started")
    config = load_config(run_dir / "config.yaml")
    if runtime.run_dir(config).resolve() != run_dir.resolve():
        raise ConfigError(f"{run_dir} is not where its config.yaml puts the run ({runtime.run_dir(config)})")
    step = checkpoint_step(run_dir)
    if step is None:
        raise ConfigError(f"{run_dir} has no trainer checkpoint to resume from; start the run again")
    if config.broker.embedded and not runtime.topics_export_path(config).is_file():
        raise ConfigError(f"{run_dir} has no topics.export: the topics of its embedded broker are lost")
    return config, step


def resume_pipeline(run_dir: Path, progress: bool = True) -> int:
    """`asyncrl run --resume RUN_DIR`: the run goes on from its newest checkpoint with its own config.yaml,
    directory, key, weights and metrics.jsonl; on the embedded broker its topics come back from its export.
    Exit codes as `run_pipeline`; a finished run says so in one line and exits 0."""
    config, step = resumable(run_dir)
    if step >= config.trainer.steps:
        print(f"asyncrl: {run_dir} already finished (step {step} of {config.trainer.steps})", file=sys.stderr)
        return 0
    return run_pipeline(config, progress, resumed_from=step)


def run_pipeline(config: RunConfig, progress: bool = True, resumed_from: int | None = None) -> int:
    """`asyncrl run`: 0 once finished, 128 + N after signal N (Ctrl-C 130, SIGTERM 143), else 1.
    `resumed_from`: the checkpoint step of a run directory's own config (`--resume`)."""
    with StopSignals() as stops:
        try:
            return run_locally(on_one_machine(config), progress, stops, resumed_from)
        except RunStopped as stop:  # before the run directory had anything to stop
            print(f"asyncrl: {stop.reason} before the run started", file=sys.stderr)
            return stop.exit_code


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Held while a launcher runs the run in `run_dir` (an flock, let go by the kernel however the launcher
    ends): a second launcher there, e.g. `--resume` of a run still running, is a one-line error, not a
    second run writing the same directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK_FILE, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            raise ConfigError(
                f"{run_dir} is being run by another launcher (pid {holder}): stop it first (Ctrl-C or SIGTERM)"
            ) from None
        except OSError as exc:  # a file system without flock (some NFS and Lustre mounts)
            print(
                f"asyncrl: {run_dir} cannot be locked ({exc.strerror}): a second launcher would not be refused",
                file=sys.stderr,
            )
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        wait_for_earlier_launch(run_dir)
        yield


def wait_for_earlier_launch(run_dir: Path, timeout_s: float = EARLIER_LAUNCH_WAIT_S) -> None:
    """A killed launcher's workers end on their own (SIGTERM at its death; the trainer checkpoints first): wait
    until none is left, so that nothing of the earlier launch writes the directory while this one runs."""
    deadline = time.monotonic() + timeout_s
    if left := workers_of(run_dir):
        print(
            f"asyncrl: waiting for the run's earlier launch to end (pids {', '.join(map(str, left))})", file=sys.stderr
        )
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = workers_of(run_dir)
    if left:
        raise ConfigError(
            f"{run_dir}: processes of its earlier launch still run after {timeout_s:.0f} s (pids "
            f"{', '.join(map(str, left))}): stop them first"
        )


def workers_of(run_dir: Path) -> list[int]:
    """Live processes that run with `run_dir`'s config.yaml (every worker names it on its command line)."""
    from pipeline.chaos.procs import processes

    config = f" {run_dir / 'config.yaml'} "  # a whole argument: not another file beside it
    return [proc.pid for proc in processes().values() if config in f" {proc.cmdline} "]


def run_locally(config: RunConfig, progress: bool, stops: StopSignals, resumed_from: int | None = None) -> int:
    """Checks, a run directory (a resumed run keeps its own), the run started and followed, then always
    stopped in order and reported."""
    from pipeline import monitor
    from pipeline.eval_set import rows_for_config

    started = time.time()
    check_dataset(config)
    check_wandb(config)
    # before anything starts: a missing data.eval_source is a config error
    eval_rows = rows_for_config(config) if config.eval.enabled else None
    config = new_run_dir(config) if resumed_from is None else config
    run_dir = runtime.run_dir(config)
    with run_dir_lock(run_dir):  # a second launcher of this run (a --resume too early) stops here
        resumed = "" if resumed_from is None else f", resumed from the checkpoint of step {resumed_from}"
        print(f"asyncrl: run directory {run_dir}{resumed}", file=sys.stderr)
        # before the broker and the model: a W&B problem (no login) shows at once; W&B gets the config as given
        wandb_stream = monitor.WandbStream(config, run_dir) if config.telemetry.wandb_project else None
        run, stopped = LocalRun(config, run_dir, resumed_from), None
        try:
            run.start(stops, eval_rows, progress)
            outcome = monitor.follow(
                run.config,
                run_dir,
                run.workers,
                run.evaluation,
                started,
                progress,
                wandb_stream,
                run.metrics_offset,
                run.start_evaluator,
            )
        except RunStopped as stop:
            stopped, outcome = stop, stop.outcome
            before = "" if run.config_path else " before config.yaml was written (runs/latest left as it was)"
            print(f"asyncrl: {stop.reason}{before}; stopping every worker; run directory {run_dir}", file=sys.stderr)
        finally:
            stops.cleaning = True
            run.stop()
        if run.config_path is None:  # stopped while preparing: nothing ran, there is nothing to report
            return stopped.exit_code
        reason = stopped.reason if stopped else None
        summary = monitor.finish(run.config, run_dir, outcome, started, wandb_stream, reason)
        from pipeline.export_model import export_final  # torch: imported once the workers are done

        summary = export_final(run_dir, summary)  # <run dir>/final-model, as summary.json's exported_model
        print(json.dumps(summary, indent=2))
        return stopped.exit_code if stopped else 0 if outcome == "finished" else 1
