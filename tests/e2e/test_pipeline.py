"""The whole pipeline, as users run it: `asyncrl run` in a subprocess, one process per
worker, on the real broker; every assertion is read back from the topics themselves."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from schemas.messages import BatchManifest, PromptGroup, Scored, Segment, WeightVersion, prompt_id_of
from topics.assembly import Attempt
from topics.export import load_export
from topics.readers import read_topic

pytestmark = pytest.mark.e2e

STEPS, GROUPS, SAMPLES = 10, 4, 4
# A model without warm-up rarely emits its end token, so sequences run to
# max_new_tokens and new weights arrive while many are in flight.
SMALL_RUN = [
    f"trainer.steps={STEPS}",
    f"trainer.batch_groups={GROUPS}",
    f"data.n_samples={SAMPLES}",
    "model.warmup_steps=0",
    "rollout.max_new_tokens=40",
    "eval.enabled=false",  # ~8 s a run of waiting for the evaluator: tests/e2e/test_eval_in_run.py tests it
    "trainer.checkpoint.every=5",
    "trainer.skip_uniform_groups=0",  # every group trains (async_run drops some): the tests count groups
]


def run_pipeline(tmp_path: Path, bootstrap: str, prefix: str, *overrides: str) -> Path:
    command = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        *SMALL_RUN,
        f"runs_dir={tmp_path}",
        f"broker.bootstrap={bootstrap}",
        f"broker.topic_prefix={prefix}",
        "--no-progress",
        *overrides,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return (tmp_path / "latest").resolve()


async def read(bootstrap: str, topic: str, cls) -> list:
    records = await read_topic(bootstrap, topic, cls)
    assert all(isinstance(r.message, cls) for r in records), f"undecodable record on {topic}"
    return records


async def trained_view(bootstrap: str, prefix: str):
    """(manifests, trained Scored by trajectory id, released groups by prompt id)."""
    manifests = [r.message for r in await read(bootstrap, prefix + "batches", BatchManifest)]
    scored = {(r.partition, r.offset): r.message for r in await read(bootstrap, prefix + "scored", Scored)}
    released = {r.message.prompt_id: r.message for r in await read(bootstrap, prefix + "prompts", PromptGroup)}
    trained = {}
    for manifest in manifests:
        for trajectory_id, where in zip(manifest.trajectory_ids, manifest.scored_offsets, strict=True):
            assert scored[tuple(where)].trajectory_id == trajectory_id, "manifest offset points at another trajectory"
            trained.setdefault(trajectory_id, []).append((manifest, scored[tuple(where)]))
    return manifests, trained, released


ETA, SKIP_CAP = 4, 2


@pytest.fixture(scope="module")
def async_run(broker, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One asynchronous run that two tests read (a run is most of a test's time): η = 4 on two cores, two
    steps of each of two roles profiled, every span traced, and groups without advantage dropped (up to
    SKIP_CAP a step) and replaced. Its run directory and topic prefix."""
    prefix = f"async-{uuid.uuid4().hex[:8]}."
    run_dir = run_pipeline(
        tmp_path_factory.mktemp("async"),
        broker.bootstrap,
        prefix,
        f"trainer.max_staleness={ETA}",
        "telemetry.sample_ratio=1",
        "profile.roles=[trainer,rollout]",
        "profile.start=2",
        "profile.steps=2",
        f"trainer.skip_uniform_groups={SKIP_CAP}",
    )
    return run_dir, prefix


async def test_async_pipeline_end_to_end(broker, async_run):
    (run_dir, prefix), eta = async_run, ETA
    manifests, trained, released = await trained_view(broker.bootstrap, prefix)

    assert sorted(m.step for m in manifests) == list(range(1, STEPS + 1))
    # no (prompt, sample) trained twice
    assert all(len(uses) == 1 for uses in trained.values())
    assert len(trained) == STEPS * GROUPS * SAMPLES
    for [(manifest, scored)] in trained.values():
        group = released[scored.prompt_id]
        # every trained completion token carries a behaviour logprob and a version
        assert len(scored.completion_tokens) == len(scored.logprobs) == len(scored.versions) > 0
        assert all(math.isfinite(lp) and lp <= 0 for lp in scored.logprobs)
        assert all(group.released_at_version <= v <= manifest.trainer_version for v in scored.versions)
        # no trajectory trained at version v was released before version v - eta
        assert manifest.trainer_version - group.released_at_version <= eta
        assert scored.prompt_tokens == group.prompt_tokens
    # interruption happened: some trained trajectory holds tokens of two versions
    assert any(len(set(s.versions)) > 1 for [(_, s)] in trained.values())
    # every released group was trained or recorded as dropped with a reason
    trained_groups = {prompt_id_of(tid) for tid in trained}
    dropped = {d.prompt_id: d.reason for m in manifests for d in m.dropped}
    assert all(reason for reason in dropped.values())
    assert set(released) == trained_groups | set(dropped)

    await check_segments_behind(trained, broker.bootstrap, prefix)
    weights = [r.message for r in await read(broker.bootstrap, prefix + "weights", WeightVersion)]
    assert max(w.version for w in weights) == STEPS and any(w.final for w in weights)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["outcome"] == "finished"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {line["threads"] for line in steps if line["source"] == "trainer"} == {1}  # its share of the two cores
    assert summary["interrupted_trajectories"] > 0
    assert summary["max_staleness_trained"] <= eta
    # eval.enabled=false: no evaluator, no eval line, and no accuracy, not even the base model's
    assert summary["base_accuracy"] is None and summary["final_accuracy"] is None
    assert not any(line["source"] == "eval" for line in steps) and not (run_dir / "logs" / "eval-0.stdout").exists()
    for artifact in ("curves.png", "metrics.jsonl", "config.yaml", "tensorboard"):
        assert (run_dir / artifact).exists(), artifact
    assert {p.name.split("-")[0] for p in (run_dir / "logs").glob("*.jsonl")} == {
        "trainer",
        "reward",
        "rollout",
        "prompts",
    }

    check_one_trace_per_prompt(run_dir, prompt_id_of(next(iter(trained))))
    ops_of_role = (("trainer", "aten::_fused_adamw_"), ("rollout", "aten::_index_put_impl_"))  # AdamW; KV cache writes
    for role, op in ops_of_role:  # steps 3-4 of each
        [ops] = (run_dir / "profile").glob(f"{role}-*.ops.txt")
        assert ops.read_text().startswith(f"{ops.name.removesuffix('.ops.txt')}: steps 3-4") and op in ops.read_text()
        assert (run_dir / "profile" / ops.name.replace(".ops.txt", ".trace.json")).stat().st_size > 0


async def check_segments_behind(trained: dict, bootstrap: str, prefix: str) -> None:
    """The segments behind the trained tokens carry the same versions, segment by segment."""
    attempts: dict[tuple[str, str], Attempt] = {}
    for seg in (r.message for r in await read(bootstrap, prefix + "segments", Segment)):
        attempts.setdefault((seg.trajectory_id, seg.attempt), Attempt(seg.trajectory_id, seg.attempt)).add(seg, None)
    for trajectory_id, [(_, scored)] in trained.items():
        assert attempts[(trajectory_id, scored.attempt)].versions == scored.versions


def check_one_trace_per_prompt(run_dir: Path, trained_prompt: str) -> None:
    """One trace follows a trained prompt through every worker, carried in the message headers."""
    spans = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    by_trace = {}
    for span in spans:
        by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    [release] = [
        s for s in spans if s["name"] == "release prompt" and s["attributes"]["asyncrl.prompt_id"] == trained_prompt
    ]
    journey = by_trace[release["context"]["trace_id"]]
    services = {s["resource"]["attributes"]["service.name"] for s in journey}
    assert services == {"asyncrl-prompts", "asyncrl-rollout", "asyncrl-reward", "asyncrl-trainer"}
    assert {s["name"] for s in journey} == {"release prompt", "generate segment", "score trajectory", "train group"}
    ids = {s["context"]["span_id"] for s in journey}
    assert all(s["parent_id"] in ids for s in journey if s is not release)  # one tree rooted at the release
    assert {s["attributes"]["asyncrl.trajectory_id"] for s in journey if s["name"] == "score trajectory"} == {
        f"{trained_prompt}/{i}" for i in range(SAMPLES)
    }


async def test_eta_zero_is_synchronous(broker, tmp_path, unique_name):
    """Also the launcher's multi-rank trainer: two FSDP2 ranks under torchrun."""
    prefix = unique_name("sync") + "."
    run_dir = run_pipeline(
        tmp_path, broker.bootstrap, prefix, "trainer.max_staleness=0", f"trainer.steps={STEPS // 2}", "trainer.ranks=2"
    )
    assert '"ranks": 2' in "".join(log.read_text() for log in (run_dir / "logs").glob("trainer-*.jsonl"))
    manifests, trained, released = await trained_view(broker.bootstrap, prefix)
    assert len(manifests) == STEPS // 2 and len(trained) == STEPS // 2 * GROUPS * SAMPLES
    for [(manifest, scored)] in trained.values():
        # every trained token was generated by the version being trained
        assert set(scored.versions) == {manifest.trainer_version}
        assert released[scored.prompt_id].released_at_version == manifest.trainer_version


async def test_groups_without_advantage_are_dropped_and_replaced(broker, async_run):
    """`trainer.skip_uniform_groups` on the real broker: the untrained model's groups all score 0,
    so each version drops up to the cap, the prompt source releases one group in place of each, and every
    released group still ends trained or recorded as dropped."""
    (run_dir, prefix), cap = async_run, SKIP_CAP
    manifests, trained, released = await trained_view(broker.bootstrap, prefix)

    no_advantage = f"uniform: all {SAMPLES} samples scored"
    uniform = [[d for d in m.dropped if d.reason.startswith(no_advantage)] for m in manifests]
    assert sorted(m.step for m in manifests) == list(range(1, STEPS + 1))
    assert all(len(drops) <= cap for drops in uniform) and sum(map(len, uniform)) > 0
    assert len(trained) == STEPS * GROUPS * SAMPLES  # the batch keeps its size
    dropped = {d.prompt_id for m in manifests for d in m.dropped}
    trained_groups = {prompt_id_of(tid) for tid in trained}
    assert not dropped & trained_groups
    assert len(released) > STEPS * GROUPS  # replacements were released
    assert set(released) == trained_groups | dropped
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["groups_dropped"] == len(dropped)


def _processes_mentioning(text: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.chaos  # short version in make test: test_clean_stops's two Ctrl-Cs, whose first is this one
def test_ctrl_c_stops_every_process(tmp_path):
    """SIGINT to `asyncrl run` (what Ctrl-C sends) leaves no worker and no broker behind."""
    command = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        *SMALL_RUN,
        "trainer.steps=1000",
        f"runs_dir={tmp_path}",
        "--no-progress",
    ]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "latest" / "metrics.jsonl"
        while not (metrics.exists() and '"trainer"' in metrics.read_text()):
            assert time.monotonic() < deadline and launcher.poll() is None, "the run never made a step"
            time.sleep(0.5)
        run_dir = str((tmp_path / "latest").resolve())
        assert len(_processes_mentioning(run_dir)) >= 4  # the workers are up, with the run's config
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    time.sleep(0.5)
    assert _processes_mentioning(run_dir) == []
    bootstrap = yaml.safe_load(Path(run_dir, "config.yaml").read_text())["broker"]["bootstrap"]
    assert _processes_mentioning(f"tcp://{bootstrap}") == []  # the run's own embedded broker
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    assert summary["outcome"] == "stopped"
    # the embedded broker's topics outlive it in the run directory, for replay
    exported = load_export(Path(run_dir, "topics.export"))
    assert len(exported.records["batches"]) >= 1 and len(exported.records["scored"]) >= GROUPS * SAMPLES


async def test_trainer_killed_mid_run_trains_everything_exactly_once(broker, tmp_path, unique_name):
    """SIGKILL the trainer after a checkpoint; the launcher restarts it and the run still trains
    every group exactly once: steps after the checkpoint are rebuilt from their manifests."""
    prefix, steps = unique_name("kill") + ".", 14
    command = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        *SMALL_RUN,
        f"trainer.steps={steps}",
        f"runs_dir={tmp_path}",
        f"broker.bootstrap={broker.bootstrap}",
        f"broker.topic_prefix={prefix}",
        "--no-progress",
    ]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        metrics = tmp_path / "latest" / "metrics.jsonl"
        while not (
            metrics.exists()
            and any(json.loads(l).get("step", 0) >= 7 for l in metrics.read_text().splitlines() if '"trainer"' in l)
        ):
            assert time.monotonic() < deadline and launcher.poll() is None, "the run never reached step 7"
            time.sleep(0.1)
        run_dir = str((tmp_path / "latest").resolve())
        [trainer] = [
            pid
            for pid in _processes_mentioning(run_dir)
            if "worker trainer" in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        ]
        os.kill(trainer, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, output[-3000:]
    assert "trainer-0 exited with -9; restarting it" in output

    manifests, trained, released = await trained_view(broker.bootstrap, prefix)
    assert sorted(m.step for m in manifests) == list(range(1, steps + 1))  # no step written twice or skipped
    assert all(len(uses) == 1 for uses in trained.values()) and len(trained) == steps * GROUPS * SAMPLES
    dropped = {d.prompt_id for m in manifests for d in m.dropped}
    assert set(released) == {prompt_id_of(tid) for tid in trained} | dropped
    weights = [r.message for r in await read(broker.bootstrap, prefix + "weights", WeightVersion)]
    assert max(w.version for w in weights) == steps
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    assert summary["steps"] == steps and summary["groups_consumed"] == steps * GROUPS
