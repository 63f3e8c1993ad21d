"""The commands in docker-compose.yml, run as local processes: they make a whole run.

No Docker engine is needed. Each asyncrl service's own `command` and `environment`
are taken from the file and run as `python -m pipeline.cli <command>` (what the
image's ENTRYPOINT `asyncrl` runs), against the session's embedded broker. Only
what must differ outside compose is rewritten: the broker address (kafka:9092), the
shared volume (/shared -> a temporary directory), and, appended to the `prepare`
command, a small run and a topic prefix of this test's own. The workers get nothing
extra: they run from the config.yaml that `prepare` wrote, as in compose.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from schemas.messages import BatchManifest, Segment, WeightVersion
from topics.readers import read_topic

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"prompts", "rollout", "reward", "trainer"}
STEPS, GROUPS, SAMPLES = 6, 2, 4
SMALL_RUN = [
    f"trainer.steps={STEPS}",
    f"trainer.batch_groups={GROUPS}",
    f"data.n_samples={SAMPLES}",
    "model.warmup_steps=0",
    "trainer.skip_uniform_groups=0",  # every group trains: these tests count groups and records
]
COMPOSE_BOOTSTRAP, SHARED = "kafka:9092", "/shared"


def asyncrl_services(compose: dict) -> dict[str, dict]:
    """The services built from infra/Dockerfile that `docker compose up` starts (no profile)."""
    return {
        name: service
        for name, service in compose["services"].items()
        if isinstance(service.get("build"), dict)
        and service["build"].get("dockerfile") == "infra/Dockerfile"
        and not service.get("profiles")
    }


def localise(word: str, bootstrap: str, shared: Path) -> str:
    word = word.replace(COMPOSE_BOOTSTRAP, bootstrap)
    return re.sub(r"(?<![\w/.])/shared(?=/|$)", str(shared), word)


def command_of(service: dict, bootstrap: str, shared: Path) -> list[str]:
    command = service["command"]
    assert isinstance(command, list), "commands are written in exec form"
    return [sys.executable, "-m", "pipeline.cli", *(localise(str(word), bootstrap, shared) for word in command)]


def interpolate(value: str) -> str:
    """Compose's `${VAR}` and `${VAR:-default}`, from this process's environment."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: os.environ.get(m[1]) or (m[2] or ""), value)


def environment_of(service: dict, bootstrap: str, shared: Path) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.split("=", 1) for item in env)
    return {**os.environ, **{key: localise(interpolate(str(value)), bootstrap, shared) for key, value in env.items()}}


def tail(path: Path, chars: int = 2000) -> str:
    return f"--- {path.name}\n" + (path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)")


def prepare_run(broker, tmp_path: Path, prefix: str, steps: int) -> tuple[dict[str, dict], Path, Path]:
    """Run the `prepare` service's command: (the role services, the shared dir, the config it wrote)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    # the image runs `asyncrl`, which is `python -m pipeline.cli`
    assert re.search(r'^ENTRYPOINT \["asyncrl"\]$', (ROOT / "infra/Dockerfile").read_text(), re.M)
    services = asyncrl_services(compose)
    assert set(services) == {"prepare", *ROLES}
    shared = tmp_path / "shared"
    shared.mkdir()
    prepare = services.pop("prepare")
    done = subprocess.run(
        [
            *command_of(prepare, broker.bootstrap, shared),
            *SMALL_RUN,
            f"trainer.steps={steps}",
            f"broker.topic_prefix={prefix}",
        ],
        env=environment_of(prepare, broker.bootstrap, shared),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    config_path = Path(done.stdout.strip().splitlines()[-1])  # prepare prints the config it wrote
    assert config_path.is_relative_to(shared) and config_path.exists()
    config = yaml.safe_load(config_path.read_text())
    assert config["broker"]["bootstrap"] == broker.bootstrap and config["broker"]["topic_prefix"] == prefix
    assert config["broker"]["partitions"] >= 3  # room for `--scale rollout=3`
    return services, shared, config_path


def start_service(name: str, service: dict, broker, shared: Path, config_path: Path, log: Path) -> subprocess.Popen:
    command = command_of(service, broker.bootstrap, shared)
    role = name.split("#")[0]
    assert command[3:5] == ["worker", role] and Path(command[6]) == config_path, command
    with open(log, "wb") as out:
        return subprocess.Popen(
            command,
            env=environment_of(service, broker.bootstrap, shared),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_services(workers: dict[str, subprocess.Popen], timeout_s: float) -> None:
    """As `docker compose stop`: SIGTERM to every live service, SIGKILL after `timeout_s`; all reaped."""
    for process in workers.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in workers.values():
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_the_trainer_then_stop(
    workers: dict[str, subprocess.Popen], logs: dict[str, Path], timeout_s: float
) -> None:
    """The trainer ends by itself after its last step; prompts and rollout stop on the final weights
    (compose leaves them down: restart on-failure); the rest gets SIGTERM as `docker compose stop` sends."""
    try:
        try:
            trainer_rc = workers["trainer"].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail("the trainer did not finish in time\n" + "\n".join(tail(p) for p in logs.values()))
        assert trainer_rc == 0, "\n".join(tail(p) for p in logs.values())
        deadline = time.monotonic() + 20  # waiting also keeps a SIGTERM from landing mid-exit
        for name, process in workers.items():
            if name.split("#")[0] in ("prompts", "rollout"):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for process in workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in workers.values():
            process.wait(timeout=20)
    finally:
        stop_services(workers, timeout_s=10)  # on any failure: nothing left behind, everything reaped
    assert {name: p.returncode for name, p in workers.items()} == dict.fromkeys(workers, 0), "\n".join(
        tail(p) for p in logs.values()
    )


async def read_run(bootstrap: str, prefix: str) -> tuple[list[BatchManifest], list[WeightVersion], list[Segment]]:
    topics = [(prefix + "batches", BatchManifest), (prefix + "weights", WeightVersion), (prefix + "segments", Segment)]
    read = [[r.message for r in await read_topic(bootstrap, topic, cls)] for topic, cls in topics]
    for messages, (topic, cls) in zip(read, topics, strict=True):
        assert all(isinstance(m, cls) for m in messages), f"undecodable record on {topic}"
    return tuple(read)


def test_compose_commands_make_a_whole_run(broker, tmp_path, unique_name):
    prefix, started = unique_name("compose") + ".", time.monotonic()
    services, shared, config_path = prepare_run(broker, tmp_path, prefix, STEPS)
    logs = {role: tmp_path / f"{role}.out" for role in services}
    workers = {
        role: start_service(role, service, broker, shared, config_path, logs[role])
        for role, service in services.items()
    }
    wait_for_the_trainer_then_stop(workers, logs, timeout_s=max(10.0, 75 - (time.monotonic() - started)))

    manifests, weights, _ = asyncio.run(read_run(broker.bootstrap, prefix))
    assert sorted(m.step for m in manifests) == list(range(1, STEPS + 1))
    assert all(len(m.trajectory_ids) == GROUPS * SAMPLES for m in manifests)
    assert len({t for m in manifests for t in m.trajectory_ids}) == STEPS * GROUPS * SAMPLES
    final = [w for w in weights if w.final]
    assert max(w.version for w in weights) == STEPS and [w.version for w in final] == [STEPS]
    assert Path(final[0].uri).is_relative_to(shared) and Path(final[0].uri).exists()  # on the shared volume


def test_scaled_up_rollout_joins_the_running_pipeline(broker, tmp_path, unique_name):
    """What `docker compose up --scale rollout=2` does to a running pipeline: a second rollout process with
    the same command joins the `prompts` consumer group, takes partitions over and generates what is then
    trained; nothing is trained twice. Then `docker compose stop` (SIGTERM to every service)."""
    prefix = unique_name("scale") + "."
    services, shared, config_path = prepare_run(broker, tmp_path, prefix, steps=100_000)
    logs = {name: tmp_path / f"{name}.out" for name in [*services, "rollout#2"]}
    workers = {
        role: start_service(role, service, broker, shared, config_path, logs[role])
        for role, service in services.items()
    }
    try:
        while not asyncio.run(read_run(broker.bootstrap, prefix))[0]:  # running: a first step was taken
            assert all(p.poll() is None for p in workers.values()), "\n".join(tail(p) for p in logs.values())
            time.sleep(0.2)
        workers["rollout#2"] = start_service(
            "rollout#2", services["rollout"], broker, shared, config_path, logs["rollout#2"]
        )
        deadline = time.monotonic() + 120
        while True:
            manifests, _, segments = asyncio.run(read_run(broker.bootstrap, prefix))
            trained = {t for m in manifests for t in m.trajectory_ids}
            by_worker: dict[str, set[str]] = {}
            for segment in segments:
                by_worker.setdefault(segment.worker_id, set()).add(segment.trajectory_id)
            if len(by_worker) == 2 and all(ids & trained for ids in by_worker.values()):
                break
            assert time.monotonic() < deadline, f"segments from {sorted(by_worker)}\n" + tail(logs["rollout#2"])
            assert all(p.poll() is None for p in workers.values()), "\n".join(tail(p) for p in logs.values())
            time.sleep(0.5)
    finally:
        stop_services(workers, timeout_s=30)  # `docker compose stop`
    assert {name: p.returncode for name, p in workers.items()} == dict.fromkeys(workers, 0), "\n".join(
        tail(p) for p in logs.values()
    )
    manifests, _, _ = asyncio.run(read_run(broker.bootstrap, prefix))
    trained = [t for m in manifests for t in m.trajectory_ids]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
