"""`asyncrl slurm submit` on a real Slurm cluster of three simulated nodes.

The session fixture (Linux, root; `make system-deps` installs Debian's slurm-wlm
and munge) starts munged, slurmctld and one slurmd
per node (`slurmd -N n1` ...) as children of the test, under a temporary
directory. The nodes n1, n2 and n3 share this host's name and 127.0.0.1 (only
SLURMD_NODENAME tells them apart, and their names resolve nowhere); each declares
two fake GPUs (gres on /dev/null links) and eight CPUs whatever the machine has:
the job asks for the CPUs its steps sum to, and nothing is pinned (task/none).

Three jobs run the real job script: the demo on one node and the embedded broker
to the end; on three nodes and an external broker (the session's), a run
cancelled with scancel once the trainer has checkpointed, then the same run name
submitted again, which resumes from that checkpoint. After each, no process of
the job may be left.
"""

from __future__ import annotations

import asyncio
import json
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

import msgspec
import pytest

from pipeline.chaos.audit import audit_export
from pipeline.config import load_config
from pipeline.retrain import load_record, retrain
from schemas.messages import BatchManifest, WeightVersion
from schemas.validate import decode
from tests.system_packages import SBIN_PATH, require_tools
from topics.export import export_topics, load_export
from workers.announce import load_key

ROOT = Path(__file__).resolve().parents[2]
SMALL_RUN = ["trainer.batch_groups=2", "data.n_samples=4", "model.warmup_steps=0", "trainer.skip_uniform_groups=0"]
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
NODES = ("n1", "n2", "n3")  # slurm.conf's names, which resolve nowhere
NODE_LIST = "n[1-3]"


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
    assert re.search(r'launch broker .*--nodelist="\$\(nodes 0\)" --gres=none', script)  # the embedded broker, node 0
    assert f"prepare {ROOT}/pipeline/configs/arith.yaml " in script
    assert f"runs_dir={tmp_path}/runs rollout.workers=4 broker.partitions=4" in script
    assert "broker.partitions=4 trainer.threads=1 rollout.threads=1" in script  # automatic: one CPU per step
    trainer = re.search(r"launch trainer (.*?)--config \"\$CONFIG\"", script, re.S).group(1)
    for part in (
        "--nodes=2 --ntasks=2 --ntasks-per-node=1",
        '--nodelist="$(nodes 0 2)" --gres=gpu:4',
        'bash -c "$ON_TRAINER_NODE"',
        "torch.distributed.run --nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "-m pipeline.cli worker trainer",
    ):
        assert part in trainer
    assert len(re.findall(r'launch rollout .*--nodelist="\$\(nodes 2\)" --gres=gpu:1 .*worker rollout', script)) == 4
    assert re.search(r'launch reward .*--nodelist="\$\(nodes 0\)" --gres=none .*worker reward', script)
    assert re.search(r'launch prompts .*--nodelist="\$\(nodes 0\)" --gres=none .*worker prompts', script)
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
        pytest.skip("a real Slurm cluster needs Linux and root (munged, slurmd)")
    require_tools(["slurmctld", "munged"], ["slurm-wlm", "munge"], "system-deps")
    root = tmp_path_factory.mktemp("slurm")
    key = write_cluster_files(root, socket.gethostname().split(".")[0])
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    daemons: list[subprocess.Popen] = []
    try:
        for command in cluster_daemons(root, key):
            name = "-".join(word for word in command if not word.startswith("-"))  # slurmd-n1
            with open(root / "log" / f"{name}.out", "wb") as out:
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
        deadline = time.monotonic() + 30
        while not all_idle(env):
            if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
                logs = "\n".join(p.read_text()[-1500:] for p in sorted((root / "log").iterdir()))
                pytest.fail(f"the Slurm nodes did not become idle\n{logs}")
            time.sleep(0.2)
        yield Cluster(env)
    finally:
        stop_jobs(env, {daemon.pid for daemon in daemons})
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=3)  # slurmctld may wait 15 s on RPCs to clients long gone: its state is throwaway
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def cluster_daemons(root: Path, key: Path) -> list[list[str]]:
    """munged, slurmctld and one slurmd per node (`-N`: which node of slurm.conf it is), in starting order."""
    munged = [
        "munged",
        "--foreground",
        "--force",
        f"--key-file={key}",
        f"--socket={root}/munge/socket",
        f"--pid-file={root}/munge/pid",
        f"--log-file={root}/log/munged.log",
        f"--seed-file={root}/munge/seed",
    ]
    return [munged, ["slurmctld", "-D", "-i"], *(["slurmd", "-D", "-N", node] for node in NODES)]


def all_idle(env: dict[str, str]) -> bool:
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True).stdout
    return states.split() == ["idle"] * len(NODES)


def write_cluster_files(root: Path, host: str) -> Path:
    """The daemons' directories, a munge key, the two fake GPUs of each node and the configs under `root`;
    the key's path."""
    for name in ("state", "spool", "log", "munge"):
        (root / name).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    for index in range(2):
        (root / f"gpu{index}").symlink_to("/dev/null")
    (root / "gres.conf").write_text(f"NodeName={NODE_LIST} Name=gpu File={root}/gpu[0-1]\n")
    (root / "slurm.conf").write_text(slurm_conf(root, host))
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


def slurm_conf(root: Path, host: str) -> str:
    """Three nodes on this host, no accounting; impossible requests fail at once (EnforcePartLimits).

    Each node is a slurmd of its own (`slurmd -N`) with its own port, spool, pid and log file (%n: the
    node's name); all three have this host's name and 127.0.0.1, and the node names resolve nowhere.
    KillWait (SIGTERM to SIGKILL after scancel) is 60 s, not 30: on 2 shared cores the job script's stop and
    its summary took up to 25 s.
    """
    nodes = "".join(
        f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=8 Gres=gpu:2 State=UNKNOWN\n"
        for node in NODES
    )
    return f"""\
ClusterName=asyncrltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
KillWait=60
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
{nodes}PartitionName=debug Nodes={NODE_LIST} Default=YES MaxTime=INFINITE State=UP
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


def completed(cluster: Cluster, arguments: list[str], cwd: Path, run_dir: Path) -> str:
    """Submit and wait: the job completed with exit code 0 and left no process; its id."""
    done = submit(*arguments, env=cluster.env, cwd=cwd)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert job_id.isdigit() and f"scancel {job_id}" in done.stderr
    job = cluster.wait(job_id, run_dir)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job_output(run_dir, job_id)
    assert_nothing_left(job_id, run_dir)
    return job_id


def cancelled(cluster: Cluster, arguments: list[str], cwd: Path, run_dir: Path, steps: int) -> tuple[str, int]:
    """Submit, scancel once the trainer has checkpointed step 2: every worker stopped by itself and no
    process is left, on any node; (the job id, the step of the newest checkpoint)."""
    done = submit(*arguments, env=cluster.env, cwd=cwd)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "step_000002.pt").exists():
        assert time.monotonic() < deadline, "no checkpoint in time\n" + job_output(run_dir, job_id)
        assert cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING"), job_output(run_dir, job_id)
        time.sleep(0.2)
    cluster.command("scancel", job_id)
    job = cluster.wait(job_id, run_dir, timeout_s=60)
    assert job["JobState"] == "CANCELLED", job_output(run_dir, job_id)
    assert_workers_stopped_cleanly(run_dir, job_id)  # SIGTERM reached each, and each stopped by itself
    assert '"stopped": true' in worker_events(run_dir)["trainer"][-1]
    assert_nothing_left(job_id, run_dir)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert checkpoints and checkpoints[-1] < f"step_{steps:06d}.pt"  # stopped mid-way
    return job_id, int(checkpoints[-1][5:11])


def trainer_starts(run_dir: Path) -> list[tuple[str, dict]]:
    """Each trainer's `trainer started` line, oldest first, with the node its log's name gives (rank 0's)."""
    starts = [
        (path.stem.split("-")[1], json.loads(line))
        for path in (run_dir / "logs").glob("trainer-*.jsonl")
        for line in path.read_text().splitlines()
        if '"trainer started"' in line
    ]
    return sorted(starts, key=lambda start: start[1]["timestamp"])


def assert_placed(run_dir: Path, jobs: int) -> None:
    """Every worker of `jobs` jobs on the node the layout names: node 0 (n1) the prompt source, the reward worker
    and a trainer rank, node 1 the other rank, node 2 the rollout worker. A worker's log is
    <role>-<node>-<pid>.jsonl, the node from its step's SLURMD_NODENAME; c10d gives rank 0 to either node."""
    placed: dict[str, list[str]] = {}
    for path in sorted((run_dir / "logs").glob("*.jsonl")):
        role, node, _ = path.stem.split("-")
        placed.setdefault(role, []).append(node)
    starts = trainer_starts(run_dir)
    assert {role: placed[role] for role in ("prompts", "reward", "rollout")} == {
        "prompts": ["n1"] * jobs,
        "reward": ["n1"] * jobs,
        "rollout": ["n3"] * jobs,
    }
    assert len(starts) == jobs and all(sorted(start["nodes"]) == ["n1", "n2"] for _, start in starts), starts
    assert all(start["nodes"][0] == node for node, start in starts)  # rank 0 wrote the log


def one_process_differences(run_dir: Path, export: Path, steps: int, elsewhere: Path) -> dict[str, float]:
    """Per tensor, the run's final weights against one process that trained the batches the run recorded,
    from the initial weights (`asyncrl replay retrain`'s code, in a run directory without the checkpoints)."""
    alone = msgspec.structs.replace(load_config(run_dir / "config.yaml"), runs_dir=str(elsewhere))
    record = load_export(export)
    manifests, scored = load_record(record.records["batches"], record.records["scored"])
    result = retrain(alone, steps, manifests, scored)
    assert result.from_step == 0 and Path(result.compared_with).is_relative_to(run_dir)
    return result.max_abs_diff


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
    run_dir = runs / "done"
    job_id = completed(slurm_cluster, arguments, tmp_path, run_dir)
    assert_workers_stopped_cleanly(run_dir, job_id)
    assert (run_dir / "checkpoints" / f"step_{steps:06d}.pt").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "pipeline.sbatch").exists()
    exported = load_export(run_dir / "topics.export")  # written before the broker step was stopped
    manifests = [decode(r.value, BatchManifest) for r in exported.records["batches"]]
    weights = [decode(r.value, WeightVersion) for r in exported.records["weights"]]
    assert sorted(m.step for m in manifests) == list(range(1, steps + 1))
    assert [w.version for w in weights if w.final] == [steps] and Path(weights[-1].uri).is_relative_to(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["outcome"], summary["steps"], summary["resumed_from"]) == ("finished", steps, [])

    # the topics died with the job: a second job for this run name is refused, before sbatch
    again = submit(*arguments, env=slurm_cluster.env, cwd=tmp_path)
    assert again.returncode == 1 and "resuming needs an external Kafka" in again.stderr


def three_nodes(broker, runs: Path, prefix: str, steps: int) -> list[str]:
    """`asyncrl slurm` arguments: --nodes 3 --trainer-nodes 2 on an external broker (the session's), run `spread`,
    a checkpoint every 2 steps, rewards that differ within a group so that every step moves the weights."""
    return [
        f"--shared={runs}",
        "--nodes=3",
        "--trainer-nodes=2",
        "name=spread",
        f"broker.bootstrap={broker.bootstrap}",
        f"broker.topic_prefix={prefix}",
        f"trainer.steps={steps}",
        "trainer.checkpoint.every=2",
        "trainer.optim.lr=1e-3",  # a step trained twice or a lost optimizer state would move weights by ~1e-3
        "data.reward=reward_plugins:coin",
        *SMALL_RUN,
    ]


def coin_cluster(slurm_cluster) -> Cluster:
    """The session's cluster, its job steps able to import tests/integration's `reward_plugins:coin`."""
    return Cluster({**slurm_cluster.env, "PYTHONPATH": str(ROOT / "tests" / "integration")})


def assert_trained_once_like_one_process(broker, run_dir: Path, prefix: str, steps: int, tmp_path: Path) -> None:
    """Every step trained once, nothing lost or trained twice (the summary's count and the topics' audit), the
    model exported, and the final weights those of one process that trained the batches the run recorded."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trained_trajectories"] == steps * 2 * 4 and Path(summary["exported_model"]).is_dir()
    export = tmp_path / "topics.export"
    asyncio.run(export_topics(broker.bootstrap, export, prefix))
    audit = audit_export(export, steps, load_key(run_dir))
    assert audit.ok and audit.trained_groups == steps * 2, audit
    # the tolerance of tests/e2e/test_trainer_resume.py: two ranks sum in another order than one process
    differences = one_process_differences(run_dir, export, steps, tmp_path / "one-process")
    assert max(differences.values()) <= 5e-5, differences
    trained = [line for line in map(json.loads, (run_dir / "metrics.jsonl").open()) if line["source"] == "trainer"]
    assert sum(line["grad_norm"] > 0 for line in trained) > steps // 2  # the weights compared are trained ones


@pytest.mark.e2e
@pytest.mark.slow
def test_three_nodes_place_every_role_and_train_like_one_process(slurm_cluster, broker, tmp_path, unique_name):
    """The trainer's two ranks meet through c10d across nodes 0 and 1, the rollout worker runs on node 2, and
    the run trains as one process would. Stopped by scancel and resumed: the chaos variant below."""
    steps, runs = 8, tmp_path / "runs"
    cluster = coin_cluster(slurm_cluster)
    prefix, run_dir = unique_name("nodes") + ".", runs / "spread"
    job = completed(cluster, three_nodes(broker, runs, prefix, steps), tmp_path, run_dir)
    assert cluster.job(job)["NodeList"] == NODE_LIST
    assert_placed(run_dir, jobs=1)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["outcome"], summary["steps"], summary["resumed_from"]) == ("finished", steps, [])
    assert_trained_once_like_one_process(broker, run_dir, prefix, steps, tmp_path)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.chaos  # ~100 s on 2 cores; its short version in make test: the test above
def test_three_nodes_resume_after_scancel(slurm_cluster, broker, tmp_path, unique_name):
    """scancel stops every step on every node; the same run name submitted again resumes from the checkpoint;
    every step is trained once, and the weights are those of one process training the same batches."""
    steps, runs = 8, tmp_path / "runs"
    cluster = coin_cluster(slurm_cluster)
    prefix, run_dir = unique_name("nodes") + ".", runs / "spread"
    arguments = three_nodes(broker, runs, prefix, steps)
    first, checkpoint = cancelled(cluster, arguments, tmp_path, run_dir, steps)
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert (stopped["outcome"], stopped["reason"]) == ("stopped", "SIGTERM (scancel or the time limit)")
    second = completed(cluster, arguments, tmp_path, run_dir)
    assert [cluster.job(job)["NodeList"] for job in (first, second)] == [NODE_LIST] * 2
    assert_placed(run_dir, jobs=2)
    assert [start["step"] for _, start in trainer_starts(run_dir)] == [0, checkpoint]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["outcome"], summary["steps"], summary["resumed_from"]) == ("finished", steps, [checkpoint])
    assert_trained_once_like_one_process(broker, run_dir, prefix, steps, tmp_path)
