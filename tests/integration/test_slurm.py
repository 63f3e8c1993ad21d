"""`asyncrl slurm submit` on a real one-node Slurm cluster.

The session fixture installs Debian's slurm-wlm and munge with apt-get when
slurmctld is missing (Linux, root), then starts munged, slurmctld and slurmd as
children of the test, under a temporary directory. The node declares two fake
GPUs (gres on /dev/null links) and eight CPUs whatever the machine has: the job
asks for the CPUs its steps sum to, and nothing is pinned (task/none).

Three jobs run the real pipeline: the demo on the embedded broker to the end;
a run on an external broker (the session's) cancelled with scancel once the
trainer has checkpointed; the same run name submitted again, which resumes from
that checkpoint. After each, no process of the job may be left.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from schemas.messages import BatchManifest, WeightVersion, decode
from topics.export import load_export
from topics.readers import read_topic

ROOT = Path(__file__).resolve().parents[2]
SMALL_RUN = ["trainer.batch_groups=2", "data.n_samples=4", "model.warmup_steps=0"]
FINAL_STATES = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
WORKER_DONE = {
    "prompts": "prompt source finished",
    "rollout": "rollout finished",
    "reward": "reward worker finished",
    "trainer": "trainer finished",
}
SBIN_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


def submit(*arguments: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "slurm", "submit", *arguments],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_dry_run_prints_the_job_and_submits_nothing(tmp_path):
    done = submit(
        "--dry-run",
        "--nodes=3",
        "--trainer-nodes=2",
        "--gpus-per-node=4",
        f"--shared={tmp_path}/runs",
        "--partition=gpu",
        "--time=1:00:00",
        "--sbatch-arg=--account=rl",
        "name=big",
        env={**os.environ, "PATH": str(tmp_path)},
        cwd=tmp_path,
    )  # no sbatch: none is needed
    assert done.returncode == 0, done.stderr
    script = done.stdout
    for option in (
        "--nodes=3",
        "--ntasks-per-node=1",
        "--gres=gpu:4",
        "--partition=gpu",
        "--time=1:00:00",
        "--account=rl",
        f"--output={tmp_path}/runs/big/slurm-%j.out",
    ):
        assert f"\n#SBATCH {option}\n" in script
    assert re.search(r"launch broker .*--relative=0 --gres=none", script)  # the embedded broker, node 0
    assert f"prepare {ROOT}/pipeline/configs/arith.yaml " in script
    assert f"runs_dir={tmp_path}/runs rollout.workers=4 broker.partitions=4" in script
    trainer = re.search(r"launch trainer (.*?)--config \"\$CONFIG\"", script, re.S).group(1)
    for part in (
        "--nodes=2 --ntasks-per-node=1",
        "--relative=0 --gres=gpu:4",
        "torch.distributed.run --nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "-m pipeline.cli worker trainer",
    ):
        assert part in trainer
    assert len(re.findall(r"launch rollout .*--relative=2 --gres=gpu:1 .*worker rollout", script)) == 4
    assert re.search(r"launch reward .*--relative=0 --gres=none .*worker reward", script)
    assert re.search(r"launch prompts .*--relative=0 --gres=none .*worker prompts", script)
    assert not (tmp_path / "runs").exists()


def test_what_is_missing_is_said_in_one_line(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}
    done = submit(f"--shared={tmp_path}/runs", env=env, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("asyncrl: sbatch not found on PATH") and done.stderr.count("\n") == 1
    done = submit("--dry-run", "--gpus-per-node=1", env=env, cwd=tmp_path)
    assert done.returncode == 1 and "need at least one GPU each" in done.stderr and done.stderr.count("\n") == 1


@dataclass
class Cluster:
    env: dict[str, str]  # for clients: SLURM_CONF

    def command(self, *words: str) -> str:
        done = subprocess.run(words, env=self.env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{' '.join(words)}: {done.stderr}"
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", self.command("scontrol", "show", "job", "-o", job_id)))

    def wait(self, job_id: str, run_dir: Path, timeout_s: float = 240) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while (job := self.job(job_id))["JobState"] not in FINAL_STATES:
            if time.monotonic() > deadline:
                self.command("scancel", job_id)
                pytest.fail(f"job {job_id} still {job['JobState']} after {timeout_s} s\n{job_output(run_dir, job_id)}")
            time.sleep(0.5)
        return job


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("a real Slurm cluster needs Linux and root (apt-get, munged, slurmd)")
    install_slurm()
    root = tmp_path_factory.mktemp("slurm")
    node = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(node)
    except OSError:
        pytest.fail(f"this host's name {node!r} does not resolve; the job's broker is reached by node name")
    key = write_cluster_files(root, node)
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    daemons: list[subprocess.Popen] = []
    try:
        for command in (
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={root}/munge/socket",
                f"--pid-file={root}/munge/pid",
                f"--log-file={root}/log/munged.log",
                f"--seed-file={root}/munge/seed",
            ],
            ["slurmctld", "-D", "-i"],
            ["slurmd", "-D", "-N", node],
        ):
            with open(root / "log" / f"{command[0]}.out", "wb") as out:
                daemons.append(
                    subprocess.Popen(
                        [shutil.which(command[0], path=SBIN_PATH), *command[1:]],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.monotonic() + 10
            while command[0] == "munged" and not (root / "munge" / "socket").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the daemons authenticate through it from their start
        cluster = Cluster(env)
        deadline = time.monotonic() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout:
            if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
                logs = "\n".join(p.read_text()[-1500:] for p in sorted((root / "log").iterdir()))
                pytest.fail(f"the Slurm node did not become idle\n{logs}")
            time.sleep(0.2)
        yield cluster
    finally:
        stop_jobs(env, {daemon.pid for daemon in daemons})
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=3)  # slurmctld may wait 15 s on RPCs to clients long gone: its state is throwaway
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def write_cluster_files(root: Path, node: str) -> Path:
    """The daemons' directories, a munge key, the two fake GPUs and the configs under `root`; the key's path."""
    for name in ("state", "spool", "log", "munge"):
        (root / name).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    for index in range(2):
        (root / f"gpu{index}").symlink_to("/dev/null")
    (root / "gres.conf").write_text(f"NodeName={node} Name=gpu File={root}/gpu[0-1]\n")
    (root / "slurm.conf").write_text(slurm_conf(root, node))
    return key


def stop_jobs(env: dict[str, str], daemons: set[int]) -> None:
    """scancel what is left, then SIGKILL any process the cluster's jobs started that still lives
    (after a failed test; proctrack/linuxproc loses track of a process whose parent died)."""
    subprocess.run(["scancel", "--partition=debug"], env=env, capture_output=True, timeout=30)
    deadline = time.monotonic() + 45
    while (
        time.monotonic() < deadline
        and subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30).stdout.strip()
    ):
        time.sleep(0.5)
    marker = f"SLURM_CONF={env['SLURM_CONF']}".encode()
    for pid, state, _, environment in processes():
        if state != "Z" and pid not in daemons and marker in environment:
            os.kill(pid, signal.SIGKILL)


def processes() -> Iterator[tuple[int, str, str, list[bytes]]]:
    """(pid, state, command line, environment) of every process but this one."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environment = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue  # gone meanwhile
        yield int(proc.name), state, command, environment


def install_slurm() -> None:
    """Debian's packages, when slurmctld is missing; a failed install fails the test, with apt's words."""
    if shutil.which("slurmctld", path=SBIN_PATH) and shutil.which("munged", path=SBIN_PATH):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]
    try:
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:  # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"could not install Slurm ({' '.join(install)}): {exc}")
    if done.returncode != 0 or not shutil.which("slurmctld", path=SBIN_PATH):
        pytest.fail(f"could not install Slurm ({' '.join(install)}):\n{(done.stdout + done.stderr)[-2000:]}")


def slurm_conf(root: Path, node: str) -> str:
    """One node, no accounting; impossible requests fail at once (EnforcePartLimits)."""
    return f"""\
ClusterName=asyncrltest
SlurmctldHost={node}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
EnforcePartLimits=ALL
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
GresTypes=gpu
NodeName={node} NodeAddr=127.0.0.1 CPUs=8 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def job_output(run_dir: Path, job_id: str) -> str:
    """The batch script's output and the end of every step's, for failure messages."""
    files = [run_dir / f"slurm-{job_id}.out", *sorted((run_dir / "logs").glob(f"*.{job_id}.*.out"))]
    return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}" for path in files if path.exists())


def leftovers(job_id: str, run_dir: Path) -> list[str]:
    """Live processes of the job: its environment, its run directory or its slurmstepd (zombies do not count)."""
    return [
        f"{pid}: {command[:200]}"
        for pid, state, command, environment in processes()
        if state != "Z"
        and (f"SLURM_JOB_ID={job_id}".encode() in environment or str(run_dir) in command or f"[{job_id}." in command)
    ]


def assert_nothing_left(job_id: str, run_dir: Path) -> None:
    deadline = time.monotonic() + 15  # slurmstepd finishes its cleanup after the job's state is final
    while (left := leftovers(job_id, run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of job {job_id} outlived it:\n" + "\n".join(left)


def worker_events(run_dir: Path) -> dict[str, list[str]]:
    """The last log line of each worker process, by role (each process writes <role>-<host>-<pid>.jsonl)."""
    events: dict[str, list[str]] = {}
    for path in sorted((run_dir / "logs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime):
        lines = path.read_text().splitlines()
        events.setdefault(path.name.split("-")[0], []).append(lines[-1] if lines else "")
    return events


def assert_workers_stopped_cleanly(run_dir: Path, job_id: str) -> None:
    """Every worker wrote its last line itself: none was killed."""
    events = worker_events(run_dir)
    unclean = {role: lines[-1] for role, lines in events.items() if WORKER_DONE[role] not in lines[-1]}
    assert set(events) == set(WORKER_DONE) and not unclean, f"{unclean}\n{job_output(run_dir, job_id)}"


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_on_the_embedded_broker_completes(slurm_cluster, tmp_path):
    """Trainer and rollout on a fake GPU each, the broker as a step of its own; the run ends with its trainer."""
    steps, runs = 3, tmp_path / "runs"
    arguments = [
        f"--shared={runs}",
        "--gpus-per-node=2",
        f"--broker-port={free_port()}",
        "name=done",
        "model.device=cpu",
        f"trainer.steps={steps}",
        *SMALL_RUN,
    ]
    done = submit(*arguments, env=slurm_cluster.env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job_id, run_dir = done.stdout.strip(), runs / "done"
    assert job_id.isdigit() and f"scancel {job_id}" in done.stderr

    job = slurm_cluster.wait(job_id, run_dir)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job_output(run_dir, job_id)
    assert_workers_stopped_cleanly(run_dir, job_id)
    assert_nothing_left(job_id, run_dir)
    assert (run_dir / "checkpoints" / f"step_{steps:06d}.pt").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "pipeline.sbatch").exists()
    exported = load_export(run_dir / "topics.export")  # written before the broker step was stopped
    manifests = [decode(r.value, BatchManifest) for r in exported.records["batches"]]
    weights = [decode(r.value, WeightVersion) for r in exported.records["weights"]]
    assert sorted(m.step for m in manifests) == list(range(1, steps + 1))
    assert [w.version for w in weights if w.final] == [steps] and Path(weights[-1].uri).is_relative_to(run_dir)

    # the topics died with the job: a second job for this run name is refused, before sbatch
    again = submit(*arguments, env=slurm_cluster.env, cwd=tmp_path)
    assert again.returncode == 1 and "resuming needs an external Kafka" in again.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_scancel_stops_every_step_and_a_resubmission_resumes(slurm_cluster, broker, tmp_path, unique_name):
    """On an external broker: scancel once the trainer has a checkpoint, then the same run name again."""
    steps, runs, prefix = 12, tmp_path / "runs", unique_name("slurm") + "."
    arguments = [
        f"--shared={runs}",
        "name=resumed",
        f"broker.bootstrap={broker.bootstrap}",
        f"broker.topic_prefix={prefix}",
        f"trainer.steps={steps}",
        "trainer.checkpoint.every=2",
        *SMALL_RUN,
    ]
    done = submit(*arguments, env=slurm_cluster.env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job_id, run_dir = done.stdout.strip(), runs / "resumed"
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "step_000002.pt").exists():
        assert time.monotonic() < deadline, "no checkpoint in time\n" + job_output(run_dir, job_id)
        assert slurm_cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING"), job_output(run_dir, job_id)
        time.sleep(0.2)
    slurm_cluster.command("scancel", job_id)
    job = slurm_cluster.wait(job_id, run_dir, timeout_s=60)
    assert job["JobState"] == "CANCELLED", job_output(run_dir, job_id)
    assert_workers_stopped_cleanly(run_dir, job_id)  # SIGTERM reached each, and each stopped by itself
    assert '"stopped": true' in worker_events(run_dir)["trainer"][-1]
    assert_nothing_left(job_id, run_dir)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert checkpoints and checkpoints[-1] < f"step_{steps:06d}.pt"  # stopped mid-way

    done = submit(*arguments, env=slurm_cluster.env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    job = slurm_cluster.wait(job_id, run_dir)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job_output(run_dir, job_id)
    assert_nothing_left(job_id, run_dir)
    started = [
        line
        for path in (run_dir / "logs").glob("trainer-*.jsonl")
        for line in path.read_text().splitlines()
        if '"trainer started"' in line
    ]
    resumed_at = max(int(re.search(r'"step": (\d+)', line).group(1)) for line in started)
    assert len(started) == 2 and resumed_at == int(checkpoints[-1][5:11])

    async def read() -> tuple[list[BatchManifest], list[WeightVersion]]:
        manifests = await read_topic(broker.bootstrap, prefix + "batches", BatchManifest)
        weights = await read_topic(broker.bootstrap, prefix + "weights", WeightVersion)
        return [r.message for r in manifests], [r.message for r in weights]

    manifests, weights = asyncio.run(read())
    assert sorted(m.step for m in manifests) == list(range(1, steps + 1))  # every step once, across both jobs
    trained = [t for m in manifests for t in m.trajectory_ids]
    assert len(trained) == len(set(trained)) == steps * 2 * 4
    assert [w.version for w in weights if w.final] == [steps]
