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
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from schemas.messages import BatchManifest, WeightVersion
from topics.readers import read_topic

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"prompts", "rollout", "reward", "trainer"}
STEPS, GROUPS, SAMPLES = 6, 2, 4
SMALL_RUN = [f"trainer.steps={STEPS}", f"trainer.batch_groups={GROUPS}", f"data.n_samples={SAMPLES}",
             "trainer.warmup_steps=0"]
COMPOSE_BOOTSTRAP, SHARED = "kafka:9092", "/shared"


def asyncrl_services(compose: dict) -> dict[str, dict]:
    """The services built from infra/Dockerfile that `docker compose up` starts (no profile)."""
    return {
        name: service for name, service in compose["services"].items()
        if isinstance(service.get("build"), dict) and service["build"].get("dockerfile") == "infra/Dockerfile"
        and not service.get("profiles")
    }


def localise(word: str, bootstrap: str, shared: Path) -> str:
    word = word.replace(COMPOSE_BOOTSTRAP, bootstrap)
    return re.sub(r"(?<![\w/.])/shared(?=/|$)", str(shared), word)


def command_of(service: dict, bootstrap: str, shared: Path) -> list[str]:
    command = service["command"]
    assert isinstance(command, list), "commands are written in exec form"
    return [sys.executable, "-m", "pipeline.cli", *(localise(str(word), bootstrap, shared) for word in command)]


def environment_of(service: dict, bootstrap: str, shared: Path) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.split("=", 1) for item in env)
    return {**os.environ, **{key: localise(str(value), bootstrap, shared) for key, value in env.items()}}


def tail(path: Path, chars: int = 2000) -> str:
    return f"--- {path.name}\n" + (path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)")


def test_compose_commands_make_a_whole_run(broker, tmp_path, unique_name):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    # the image runs `asyncrl`, which is `python -m pipeline.cli`
    assert re.search(r'^ENTRYPOINT \["asyncrl"\]$', (ROOT / "infra/Dockerfile").read_text(), re.M)
    services = asyncrl_services(compose)
    assert set(services) == {"prepare", *ROLES}
    shared, prefix = tmp_path / "shared", unique_name("compose") + "."
    shared.mkdir()
    started = time.monotonic()

    prepare = services.pop("prepare")
    done = subprocess.run(
        [*command_of(prepare, broker.bootstrap, shared), *SMALL_RUN, f"broker.topic_prefix={prefix}"],
        env=environment_of(prepare, broker.bootstrap, shared), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    config_path = Path(done.stdout.strip().splitlines()[-1])  # prepare prints the config it wrote
    assert config_path.is_relative_to(shared) and config_path.exists()
    config = yaml.safe_load(config_path.read_text())
    assert config["broker"]["bootstrap"] == broker.bootstrap and config["broker"]["topic_prefix"] == prefix
    assert config["broker"]["partitions"] >= 3  # room for `--scale rollout=3`

    workers: dict[str, subprocess.Popen] = {}
    logs = {role: tmp_path / f"{role}.out" for role in services}
    try:
        for role, service in services.items():
            command = command_of(service, broker.bootstrap, shared)
            assert command[3:5] == ["worker", role] and Path(command[6]) == config_path, command
            with open(logs[role], "wb") as log:
                workers[role] = subprocess.Popen(command, env=environment_of(service, broker.bootstrap, shared),
                                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # the trainer ends by itself after its last step
        try:
            trainer_rc = workers["trainer"].wait(timeout=max(10.0, 75 - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            pytest.fail("the trainer did not finish in time\n" + "\n".join(tail(p) for p in logs.values()))
        assert trainer_rc == 0, "\n".join(tail(p) for p in logs.values())
        # prompts and rollout stop by themselves on the final weights (compose leaves them down:
        # restart on-failure); waiting for them also keeps a SIGTERM from landing mid-exit
        deadline = time.monotonic() + 20
        for role in ("prompts", "rollout"):
            try:
                workers[role].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # the rest (the reward worker) is stopped as `docker compose stop` does it: SIGTERM
        for process in workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in workers.values():
            process.wait(timeout=20)
    finally:
        for process in workers.values():  # on any failure: nothing left behind, everything reaped
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
            process.wait()
    assert {role: p.returncode for role, p in workers.items()} == dict.fromkeys(workers, 0), \
        "\n".join(tail(p) for p in logs.values())

    async def read() -> tuple[list, list]:
        manifests = await read_topic(broker.bootstrap, prefix + "batches", BatchManifest)
        weights = await read_topic(broker.bootstrap, prefix + "weights", WeightVersion)
        return [r.message for r in manifests], [r.message for r in weights]

    manifests, weights = asyncio.run(read())
    assert all(isinstance(m, BatchManifest) for m in manifests) and all(isinstance(w, WeightVersion) for w in weights)
    assert sorted(m.step for m in manifests) == list(range(1, STEPS + 1))
    assert all(len(m.trajectory_ids) == GROUPS * SAMPLES for m in manifests)
    assert len({t for m in manifests for t in m.trajectory_ids}) == STEPS * GROUPS * SAMPLES
    final = [w for w in weights if w.final]
    assert max(w.version for w in weights) == STEPS and [w.version for w in final] == [STEPS]
    assert Path(final[0].uri).is_relative_to(shared) and Path(final[0].uri).exists()  # on the shared volume
