"""`asyncrl run --resume` on the embedded broker, with real signals to real processes: a run killed (SIGKILL of
the launcher, SIGKILL of its broker) or stopped (SIGTERM) after a checkpoint is finished by a new launcher on a
new broker loaded from the run's export, and every step is trained once across the stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config, resolve, save_config
from schemas.messages import BatchManifest, PromptGroup, Scored, WeightVersion, prompt_id_of
from schemas.validate import decode
from tests.e2e.test_clean_stops import Launch, alive, mentioning
from topics.export import load_export

pytestmark = pytest.mark.e2e

STEPS, EVERY, GROUPS, SAMPLES = 20, 3, 2, 2  # GROUPS and SAMPLES as SMALL_RUN has them
KEEP = 4  # weight versions kept
RESUMABLE = (f"trainer.steps={STEPS}", f"trainer.checkpoint.every={EVERY}", f"trainer.checkpoint.keep_versions={KEEP}")


@pytest.fixture
def launch(tmp_path: Path):
    """Starts a run and returns it past trainer step EVERY + 1: after its first checkpoint (unless overridden)
    and a step beyond it, which a stop may lose."""
    started: list[Launch] = []

    def start(*overrides: str) -> Launch:
        started.append(Launch(tmp_path, *RESUMABLE, *overrides))
        run = started[-1]
        run.wait_for(lambda: trainer_step(run) > EVERY, 240, f"trainer step {EVERY + 1}")
        assert trainer_step(run) < STEPS, "the run finished before it could be stopped"
        run.processes()  # remembered, for kill_all
        return run

    yield start
    for run in started:
        run.kill_all()


def trainer_step(run: Launch) -> int:
    metrics = [path / "metrics.jsonl" for path in run.new_dirs() if (path / "metrics.jsonl").exists()]
    written = [line for path in metrics for line in path.read_text().splitlines(keepends=True)]
    lines = [json.loads(line) for line in written if line.endswith("\n")]  # not a line being written
    return max((line["step"] for line in lines if line["source"] == "trainer"), default=0)


def newest_checkpoint(run_dir: Path) -> int:
    """The step of the newest checkpoint, which the run's export must cover: its manifests at least."""
    step = max(int(path.stem.removeprefix("step_")) for path in (run_dir / "checkpoints").glob("step_*.pt"))
    assert len(load_export(run_dir / "topics.export").records["batches"]) >= step
    return step


def resume(run_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pipeline.cli", "run", "--resume", str(run_dir), "--no-progress"]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


def check_trained_once(run_dir: Path, done: subprocess.CompletedProcess, checkpoint: int) -> None:
    """The resumed run finished as a never-stopped run does: steps 1..STEPS once each, GROUPS x SAMPLES
    trajectories per step, none trained twice, every released group trained, each manifest's `scored`
    offsets naming its own trajectories in the re-imported topics, versions 0..STEPS announced."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from the checkpoint of step {checkpoint}" in done.stderr and "Traceback" not in done.stderr
    export = load_export(run_dir / "topics.export")
    decoded = {role: [decode(r.value, cls) for r in export.records[role]] for role, cls in
               (("batches", BatchManifest), ("prompts", PromptGroup), ("weights", WeightVersion))}  # fmt: skip
    manifests = decoded["batches"]
    assert [m.step for m in manifests] == list(range(1, STEPS + 1))
    assert [len(m.trajectory_ids) for m in manifests] == [GROUPS * SAMPLES] * STEPS
    trained = Counter(t for m in manifests for t in m.trajectory_ids)
    assert max(trained.values()) == 1 and len(trained) == STEPS * GROUPS * SAMPLES
    dropped = Counter(d.prompt_id for m in manifests for d in m.dropped)  # groups without advantage, if dropping
    assert set(dropped.values()) <= {1} and not set(dropped) & {prompt_id_of(t) for t in trained}
    released = Counter(g.prompt_id for g in decoded["prompts"])
    assert max(released.values()) == 1 and set(released) == {prompt_id_of(t) for t in trained} | set(dropped)
    scored = {(r.partition, r.offset): r.value for r in export.records["scored"]}
    for manifest in manifests:
        named = [decode(scored[tuple(where)], Scored).trajectory_id for where in manifest.scored_offsets]
        assert named == manifest.trajectory_ids, manifest.step
    versions = [w.version for w in decoded["weights"]]
    assert set(versions) == set(range(STEPS + 1)) and decoded["weights"][-1].final
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["outcome"], summary["steps"], summary["resumed_from"]) == ("finished", STEPS, [checkpoint])
    assert summary["trained_trajectories"] == STEPS * GROUPS * SAMPLES
    assert summary["groups_dropped"] == dropped.total()
    assert mentioning(str(run_dir)) == []


def wait_until_gone(run: Launch, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while alive(run.seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [run.seen[pid] for pid in alive(run.seen)] == []


def test_a_sigkilled_launcher_s_run_is_resumed(launch) -> None:
    run = launch()
    [trainer] = [pid for pid, cmdline in run.processes().items() if " worker trainer " in cmdline]
    os.kill(trainer, signal.SIGSTOP)  # held mid-run: it cannot train its last steps while the resume starts
    try:  # (a 20-step run on a slow machine once finished while the resume imported, and was not refused)
        refused = resume(run.run_dir)  # too early: the run still runs
    finally:
        os.kill(trainer, signal.SIGCONT)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"asyncrl: {run.run_dir} is being run by another launcher (pid {run.process.pid}): stop it first "
        "(Ctrl-C or SIGTERM)"
    ]
    run.process.kill()
    run.process.wait()
    wait_until_gone(run, within_s=10)  # the broker took the topics with it: only the export is left
    bootstrap = yaml.safe_load((run.run_dir / "config.yaml").read_text())["broker"]["bootstrap"]
    assert mentioning(str(run.run_dir), f"tcp://{bootstrap}") == []  # nothing orphaned, not even its children
    checkpoint = newest_checkpoint(run.run_dir)  # a periodic one, or the stop's if its export beat the broker
    assert checkpoint >= EVERY
    abandoned = got_ahead_of_the_export(run.run_dir, checkpoint)
    check_trained_once(run.run_dir, resume(run.run_dir), checkpoint)
    [start] = [line for line in trainer_starts(run.run_dir) if line["step"] == checkpoint]
    assert start["abandoned_versions_deleted"] == abandoned


def got_ahead_of_the_export(run_dir: Path, checkpoint: int) -> list[int]:
    """The weights a trainer killed KEEP versions past its last checkpoint leaves: only versions its export
    does not name (the resumed trainer, writing its checkpoint's version, must not delete it as the oldest)."""
    weights = run_dir / "weights"
    newest = max(weights.glob("v*.safetensors")).read_bytes()
    for old in weights.glob("v*.safetensors"):
        old.unlink()
    abandoned = list(range(checkpoint + 1, checkpoint + KEEP + 1))
    for version in abandoned:
        (weights / f"v{version:06d}.safetensors").write_bytes(newest)
    return abandoned


def trainer_starts(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for log in (run_dir / "logs").glob("trainer-*.jsonl")
        for line in log.read_text().splitlines()
        if '"trainer started"' in line
    ]


@pytest.mark.chaos  # short version in make test: the sigkilled launcher's resume, and the broker's death failing the run
def test_a_run_whose_broker_was_sigkilled_is_resumed(launch) -> None:
    run = launch()
    [broker] = [pid for pid, cmdline in run.processes().items() if "tansu" in cmdline]
    os.kill(broker, signal.SIGKILL)
    assert run.process.wait(timeout=60) == 1
    wait_until_gone(run, within_s=5)
    assert json.loads((run.run_dir / "summary.json").read_text())["outcome"] == "failed"
    checkpoint = newest_checkpoint(run.run_dir)
    check_trained_once(run.run_dir, resume(run.run_dir), checkpoint)


@pytest.mark.chaos  # short version in make test: the sigkilled launcher's resume, and SIGTERM's own checkpoint (test_clean_stops)
@pytest.mark.parametrize("skip", [0, 16], ids=["every-group-trained", "groups-without-advantage-dropped"])
def test_a_sigtermed_run_is_resumed(launch, skip: int) -> None:
    """With dropping (every group of the untrained model scores 0), the stop comes while the trainer holds
    drops no manifest records yet: its checkpoint must keep them (`restore`), or they are lost."""
    run = launch("trainer.checkpoint.every=100", f"trainer.skip_uniform_groups={skip}")  # the stop's own checkpoint
    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(timeout=240) == 128 + signal.SIGTERM
    wait_until_gone(run, within_s=5)
    stopped_at = json.loads((run.run_dir / "summary.json").read_text())["steps"]
    assert newest_checkpoint(run.run_dir) == stopped_at  # the stop checkpointed, its topics exported first
    assert len(load_export(run.run_dir / "topics.export").records["batches"]) == stopped_at
    check_trained_once(run.run_dir, resume(run.run_dir), stopped_at)


def test_resume_says_in_one_line_what_it_cannot_or_need_not_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "never"
    run_dir.mkdir(parents=True)
    done = resume(run_dir)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"asyncrl: {run_dir} has no config.yaml: not a run directory, or one stopped before it started"
    ]
    config = resolve(load_config(None, ["name=never", f"runs_dir={tmp_path / 'runs'}", "trainer.steps=5"]))
    save_config(config, run_dir / "config.yaml")
    done = resume(run_dir)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"asyncrl: {run_dir} has no trainer checkpoint to resume from; start the run again"
    ]
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step_000005.pt").touch()  # the name alone says where the trainer would resume
    done = resume(run_dir)
    assert done.returncode == 0 and done.stderr.strip().splitlines() == [
        f"asyncrl: {run_dir} already finished (step 5 of 5)"
    ]
