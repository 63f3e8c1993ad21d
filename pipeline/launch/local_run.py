"""`asyncrl run` on one machine: what it started, recorded as it starts, followed, and stopped in order."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from pipeline.config import on_one_machine, resolve, save_config
from pipeline.forkserver import ForkServer, reap_strays
from pipeline.launch.resume import import_run_topics, resumable, run_dir_lock
from pipeline.launch.run_dir import check_dataset, check_wandb, link_latest, new_run_dir, prepare
from pipeline.launch.stop_signals import RunStopped, StopSignals
from pipeline.launch.worker_processes import WorkerProcess, stop_at_once
from schemas.config import RunConfig
from workers import runtime

if TYPE_CHECKING:
    from topics.broker import EmbeddedBroker
    from workers.evaluator.worker import EvalRequests


STOP_ORDER = ("prompts", "rollout", "reward", "trainer")  # the trainer last: it checkpoints on stop; then the
# evaluator scores what it was asked for (`LocalRun.finish_evaluation`)
BROKER_GONE_STOP_S = 5.0  # all workers at once: without a broker nothing flows, a delivery would wait 40 s
EVAL_STALL_S = 600.0  # an evaluator that scores no queued version for this long once the workers stopped is stopped
EVAL_MARGIN_S = 60.0  # past max_wall_s, the final evaluation is stopped (its versions noted as failed): a run with
# max_wall_s ends within about max_wall_s + EVAL_MARGIN_S + the workers' stop (docs: Promises)


def export_topics_quietly(config: RunConfig, run_dir: Path) -> None:
    """Append what the topics gained since the trainer's last checkpoint to `<run dir>/topics.export`, for
    replay and `--resume`; a failure costs the file's newest records, not the run."""
    from topics.export import append_export

    try:
        asyncio.run(append_export(config.broker.bootstrap, run_dir / "topics.export", config.broker.topic_prefix))
    except Exception as exc:  # the run's results are already safe; say what is missing
        print(f"asyncrl: topics not exported ({exc})", file=sys.stderr)


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
    started: float = field(default_factory=time.time)  # when `asyncrl run` started (max_wall_s counts from it)

    def start(self, stops: StopSignals, eval_rows: list | None, progress: bool) -> None:
        """The fork server on CPU (importing the workers' code meanwhile), the broker, the model and topics
        (config.yaml), the evaluator's queue, asked first for the base model (a resumed run has it in
        metrics.jsonl), then the workers (the evaluator: `start_evaluator`)."""
        from pipeline import monitor
        from workers.evaluator.rows import NO_EVAL_SET
        from workers.evaluator.worker import EvalRequests

        if self.config.model.device == "cpu":  # a CUDA driver touched before a fork is unusable in the child
            self.start_fork_server(evaluates=eval_rows is not None)
        if self.config.launcher.embedded_broker:  # `on_one_machine`: none given, or a config.yaml run again
            self.start_broker(stops)
        self.config, self.config_path = prepare(self.config, progress)
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
        the evaluator's now) before summary.json is written. An evaluator stalled for EVAL_STALL_S, or still
        scoring EVAL_MARGIN_S past max_wall_s, is stopped; what it left unscored is noted as failed."""
        from pipeline import monitor

        version = monitor.final_version(self.run_dir)
        if version is not None and not any(w.role == "eval" for w in self.workers):
            self.start_evaluator()  # the run ended before the monitor saw its first step
        evaluator = next((w for w in self.workers if w.role == "eval"), None)
        if evaluator is None or evaluator.process is None:
            return
        if version is not None and evaluator.process.poll() is None:
            self.evaluation.ask(version, wait_s=0)
        self.evaluation.close()
        pending, progress_at = self.evaluation.pending(), time.monotonic()
        if pending > 1 and evaluator.process.poll() is None:
            print(f"asyncrl: scoring the {pending} versions still queued for evaluation", file=sys.stderr)
        deadline = self.started + self.config.max_wall_s + EVAL_MARGIN_S if self.config.max_wall_s else None
        why = None
        while evaluator.process.poll() is None:
            if (left := self.evaluation.pending()) < pending:
                pending, progress_at = left, time.monotonic()
            if time.monotonic() - progress_at > EVAL_STALL_S:
                why = f"the evaluator scored nothing in {EVAL_STALL_S:.0f} s; stopped"
            elif deadline is not None and time.time() > deadline:
                why = f"the evaluator was still scoring {EVAL_MARGIN_S:.0f} s past max_wall_s; stopped"
            else:
                time.sleep(0.05)
                continue
            print(f"asyncrl: {why}", file=sys.stderr)
            evaluator.stop()
        self.note_unscored(
            why or f"the evaluator ended (exit {evaluator.process.poll()}; its log: {evaluator.log_path})"
        )

    def note_unscored(self, reason: str) -> None:
        """An `eval_failed` line for each version the evaluator left in its queue (summary.json lists them)."""
        from workers.evaluator.worker import note_failed, queue_dir, queued, version_of

        for request in queued(queue_dir(self.run_dir)):
            note_failed(self.run_dir, version_of(request), f"not scored: {reason}")
            request.unlink()

    def start_broker(self, stops: StopSignals) -> None:
        """The embedded broker on a free port. On a resume the run's topics and its groups' committed offsets
        come back from its export first, and config.yaml names the new address (prepare reads it back)."""
        from topics.broker import EmbeddedBroker

        with StopSignals.held():  # a stop inside its Popen would leave it running unrecorded
            self.broker = EmbeddedBroker(self.run_dir / "broker.log").start()
        stops.watch(self.broker)
        broker = msgspec.structs.replace(self.config.broker, bootstrap=self.broker.bootstrap)
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


def run_pipeline(config: RunConfig, progress: bool = True, resumed_from: int | None = None) -> int:
    """`asyncrl run`: 0 once finished, 128 + N after signal N (Ctrl-C 130, SIGTERM 143), else 1.
    `resumed_from`: the checkpoint step of a run directory's own config (`--resume`)."""
    with StopSignals() as stops:
        try:
            return run_locally(on_one_machine(config), progress, stops, resumed_from)
        except RunStopped as stop:  # before the run directory had anything to stop
            print(f"asyncrl: {stop.reason} before the run started", file=sys.stderr)
            return stop.exit_code


def resume_pipeline(run_dir: Path, progress: bool = True) -> int:
    """`asyncrl run --resume RUN_DIR`: the run goes on from its newest checkpoint with its own config.yaml,
    directory, key, weights and metrics.jsonl; on the embedded broker its topics come back from its export.
    Exit codes as `run_pipeline`; a finished run says so in one line and exits 0. The directory is named as
    resolved (`runs/latest` is the newest run started, even one stopped before it had a checkpoint)."""
    run_dir = run_dir.resolve()
    config, step = resumable(run_dir)
    if step >= config.trainer.steps:
        print(f"asyncrl: {run_dir} already finished (step {step} of {config.trainer.steps})", file=sys.stderr)
        return 0
    return run_pipeline(config, progress, resumed_from=step)


def run_locally(config: RunConfig, progress: bool, stops: StopSignals, resumed_from: int | None = None) -> int:
    """Checks, a run directory (a resumed run keeps its own), the run started and followed, then always
    stopped in order and reported."""
    from pipeline import monitor
    from workers.evaluator.rows import rows_for_config

    started = time.time()
    check_dataset(config)
    check_wandb(config)
    # before anything starts: a missing data.eval_source is a config error
    eval_rows = rows_for_config(config) if config.eval.enabled else None
    config = new_run_dir(config) if resumed_from is None else config
    run_dir = runtime.run_dir(config)
    with run_dir_lock(run_dir):  # a second launcher of this run (a --resume too early) stops here
        link_latest(run_dir)  # from its start: `--resume runs/latest` after a stop in the warm-up finds this one
        resumed = "" if resumed_from is None else f", resumed from the checkpoint of step {resumed_from}"
        model = resolve(config).model  # model.dtype=auto's choice, said once
        precision = f"{model.dtype} on {model.device}"
        print(f"asyncrl: run directory {run_dir}{resumed}; {precision}", file=sys.stderr)
        # before the broker and the model: a W&B problem (no login) shows at once; W&B gets the config as given
        wandb_stream = monitor.WandbStream(config, run_dir) if config.telemetry.wandb_project else None
        run, stopped = LocalRun(config, run_dir, resumed_from, started=started), None
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
            before = "" if run.config_path else " before config.yaml was written (nothing to resume: start it again)"
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
