"""Every way `asyncrl run` can be stopped, with real signals to real processes: a stop signal still leaves
the trainer's checkpoint, summary.json and the topic export, and no stop leaves a process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from topics.export import load_export

pytestmark = pytest.mark.e2e

LOOPBACK_HEX = "0100007F:"  # 127.0.0.1 in /proc/net/tcp

# The demo task, untrained and small; checkpoints only at a stop, so the one found was written by the stop.
SMALL_RUN = [
    "trainer.steps=1000",
    "trainer.batch_groups=2",
    "data.n_samples=2",
    "model.warmup_steps=0",
    "rollout.max_new_tokens=8",
    "eval.every=0",
    "eval.max_rows=4",
    "trainer.checkpoint.every=1000",
    "trainer.skip_uniform_groups=0",  # every group trains: these tests count groups and records
]


class Launch:
    """One `asyncrl run` in a process group of its own, as a terminal runs it (Ctrl-C goes to the group)."""

    def __init__(self, tmp_path: Path, *overrides: str):
        self.runs = tmp_path / "runs"
        self.earlier = set(self.runs.iterdir()) if self.runs.exists() else set()
        command = [sys.executable, "-m", "pipeline.cli", "run", *SMALL_RUN, f"runs_dir={self.runs}", *overrides]
        with open(tmp_path / "stdout", "wb") as stdout, open(tmp_path / "stderr", "wb") as stderr:
            self.process = subprocess.Popen(
                [*command, "--no-progress"], stdout=stdout, stderr=stderr, start_new_session=True
            )
        self.stderr_path, self.seen = tmp_path / "stderr", {}

    def wait_for(self, condition, timeout_s: float, what: str) -> None:
        """Poll `condition`; a launcher that ends first fails the test with its stderr."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.process.poll() is None, f"the launcher ended before {what}:\n{self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
            time.sleep(0.2)

    def new_dirs(self) -> list[Path]:
        """The run directory this launch made, once it exists (`latest` may name another, or none)."""
        return [p for p in self.runs.glob("*") if p.is_dir() and not p.is_symlink() and p not in self.earlier]

    @property
    def run_dir(self) -> Path:
        [run_dir] = self.new_dirs()
        return run_dir

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def trained(self) -> bool:
        """The trainer has made a step: a stop now has something to checkpoint."""
        metrics = [path / "metrics.jsonl" for path in self.new_dirs() if (path / "metrics.jsonl").exists()]
        return any('"source": "trainer"' in path.read_text() for path in metrics)

    def workers_up(self) -> bool:
        """Every role has opened its log: the workers are starting, their Kafka clients maybe not yet up."""
        logs = [path.name.split("-")[0] for run_dir in self.new_dirs() for path in run_dir.glob("logs/*.jsonl")]
        return len(set(logs)) == 4

    def processes(self) -> dict[int, str]:
        """Every live process the launcher started (broker, workers and theirs), remembered for `kill_all`."""
        found = descendants(self.process.pid)
        self.seen |= found
        return found

    def signal_group(self, signum: int) -> None:
        """What a terminal's Ctrl-C does: the signal to the launcher's whole process group."""
        os.killpg(self.process.pid, signum)

    def kill_all(self) -> None:
        """After a failed assertion: nothing of this test may outlive it."""
        self.process.kill()
        self.process.wait()
        for pid in alive(self.seen):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launch(tmp_path: Path):
    """Starts runs; whatever a failed test left running is killed."""
    started = []

    def start(*overrides: str) -> Launch:
        started.append(Launch(tmp_path, *overrides))
        return started[-1]

    yield start
    for run in started:
        run.kill_all()


def descendants(pid: int) -> dict[int, str]:
    """Every live process under `pid` (children, theirs...), with its command line."""
    parents, cmdlines = {}, {}
    for entry in (entry for entry in Path("/proc").iterdir() if entry.name.isdigit()):
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] != "Z":
                parents[int(entry.name)] = int(stat[1])
                cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child in [child for child, ppid in parents.items() if ppid == parent]:
            found[child] = cmdlines[child]
            frontier.append(child)
    return found


def alive(processes: dict[int, str]) -> list[int]:
    """Those of `processes` still running (same pid, same command line, not a zombie)."""
    left = []
    for pid, cmdline in processes.items():
        try:
            now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if now == cmdline and state != "Z":
            left.append(pid)
    return left


def mentioning(*texts: str) -> list[str]:
    """Live processes whose command line contains one of `texts` (a run directory, a broker's address)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(text in cmdline for text in texts):
            found.append(cmdline)
    return found


def listening(pids) -> list[str]:
    """The TCP addresses (hex `host:port` as /proc/net writes them) on which any of `pids` listens."""
    sockets = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    sockets.add(os.readlink(fd))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and f"socket:[{fields[9]}]" in sockets:  # 0A: LISTEN
                found.append(fields[1])
    return found


def started_run(launch, *overrides: str) -> tuple[Launch, dict[int, str]]:
    """A run past its first trainer step, and the processes it started: broker, workers and theirs."""
    run = launch(*overrides)
    run.wait_for(run.trained, 240, "trainer step")
    processes = run.processes()
    assert sum("tansu" in cmdline for cmdline in processes.values()) == 1
    assert sum(" worker " in cmdline for cmdline in processes.values()) >= 4
    addresses = listening([run.process.pid, *processes])
    assert addresses and all(address.startswith(LOOPBACK_HEX) for address in addresses), addresses
    return run, processes


def check_nothing_left(run: Launch, processes: dict[int, str], within_s: float) -> None:
    """None of `processes` is alive `within_s` from now, nor anything naming the run or its broker."""
    deadline = time.monotonic() + within_s
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [processes[pid] for pid in alive(processes)] == []
    bootstrap = yaml.safe_load((run.run_dir / "config.yaml").read_text())["broker"]["bootstrap"]
    assert mentioning(str(run.run_dir), f"tcp://{bootstrap}") == []


def check_stopped_and_reported(run: Launch, processes: dict[int, str], signame: str) -> None:
    """Stopped, said so in one line with the run directory, and left its checkpoint, summary and export."""
    check_nothing_left(run, processes, within_s=1)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["outcome"] == "stopped" and summary["reason"] == f"{signame} received"
    [checkpoint] = (run.run_dir / "checkpoints").glob("step_*.pt")  # every=1000: the stop wrote it
    assert int(checkpoint.stem[5:]) == summary["steps"] > 0
    export = load_export(run.run_dir / "topics.export")
    assert len(export.records["batches"]) >= summary["steps"]
    said = [line for line in run.stderr.splitlines() if f"{signame} received" in line]
    assert len(said) == 1 and str(run.run_dir) in said[0], run.stderr
    assert "Traceback" not in run.stderr


def test_sigterm_stops_everything_in_order_and_reports(launch) -> None:
    run, processes = started_run(launch)
    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(timeout=90) == 128 + signal.SIGTERM
    check_stopped_and_reported(run, processes, "SIGTERM")


def test_a_second_ctrl_c_does_not_cut_the_cleanup_short(launch) -> None:
    """Also through torchrun: two trainer ranks, whose rendezvous listens on loopback too."""
    run, processes = started_run(launch, "trainer.ranks=2")
    assert sum(" worker trainer " in cmdline for cmdline in processes.values()) == 3  # torchrun and 2 ranks
    run.signal_group(signal.SIGINT)
    time.sleep(0.5)  # the workers are stopping now
    run.signal_group(signal.SIGINT)
    assert run.process.wait(timeout=90) == 128 + signal.SIGINT
    check_stopped_and_reported(run, processes, "SIGINT")
    assert "already stopping" in run.stderr


@pytest.mark.chaos  # short version in make test: test_resume's sigkilled launcher, whose processes must all be gone
def test_sigkill_of_the_launcher_leaves_no_process(launch) -> None:
    run = launch()
    run.wait_for(run.workers_up, 240, "four workers")
    processes = run.processes()
    assert any("tansu" in cmdline for cmdline in processes.values())
    run.process.kill()
    run.process.wait()
    check_nothing_left(run, processes, within_s=10)  # the broker at once; an orphaned worker 5 s at most


def test_the_broker_s_death_fails_the_run_at_once(launch) -> None:
    run, processes = started_run(launch)
    [broker] = [pid for pid, cmdline in processes.items() if "tansu" in cmdline]
    os.kill(broker, signal.SIGKILL)
    killed = time.monotonic()
    while "embedded broker exited" not in run.stderr and time.monotonic() < killed + 3:
        time.sleep(0.1)
    assert "embedded broker exited" in run.stderr  # at once, not when a worker gives up on it
    assert run.process.wait(timeout=60) == 1
    assert time.monotonic() - killed < 20  # the trainer alone would give up after 77 s
    check_nothing_left(run, processes, within_s=1)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["outcome"] == "failed" and "embedded broker exited with code -9" in summary["reason"]
    assert summary["steps"] > 0 and not (run.run_dir / "topics.export").exists()  # its topics died with it
    said = [line for line in run.stderr.splitlines() if "embedded broker exited" in line]
    assert len(said) == 1 and "broker.log" in said[0] and str(run.run_dir) in said[0], run.stderr
    assert "Traceback" not in run.stderr


def earlier_run(tmp_path: Path) -> None:
    """A run before this test's, named by `runs/latest`."""
    earlier = tmp_path / "runs" / "earlier"
    earlier.mkdir(parents=True)
    (earlier / "config.yaml").write_text("name: earlier\n")
    (tmp_path / "runs" / "latest").symlink_to("earlier")


def stopped_in_the_warm_up(launch, signum: int) -> tuple[Launch, dict[int, str]]:
    """A run stopped by `signum` to its process group while the launcher builds or warms up the model."""
    run = launch("model.warmup_steps=5000")
    run.wait_for(lambda: any((path / "model").exists() for path in run.new_dirs()), 120, "demo model")
    time.sleep(1)  # building or warming up the model, in the launcher itself
    processes = run.processes()
    run.signal_group(signum)
    assert run.process.wait(timeout=30) == 128 + signum
    assert not (run.run_dir / "config.yaml").exists()  # it was stopped before the model was ready
    return run, processes


def test_ctrl_c_during_the_warm_up_is_one_line_and_links_latest_to_the_stopped_run(launch, tmp_path: Path) -> None:
    earlier_run(tmp_path)
    run, processes = stopped_in_the_warm_up(launch, signal.SIGINT)
    assert os.readlink(tmp_path / "runs" / "latest") == run.run_dir.name  # linked as the run directory was made
    assert "Traceback" not in run.stderr
    said = [line for line in run.stderr.splitlines() if "SIGINT received" in line]
    assert len(said) == 1 and str(run.run_dir) in said[0], run.stderr
    assert alive(processes) == []


def test_resume_of_latest_after_sigterm_in_the_warm_up_refuses_naming_the_stopped_run(launch, tmp_path: Path) -> None:
    """`runs/latest` names the run just stopped, not the one before it: `--resume runs/latest` refuses in one line
    that names that run and says why (nothing was written to resume from)."""
    earlier_run(tmp_path)
    run, processes = stopped_in_the_warm_up(launch, signal.SIGTERM)
    resume = [sys.executable, "-m", "pipeline.cli", "run", "--resume", str(tmp_path / "runs" / "latest")]
    refused = subprocess.run(resume, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    [said] = refused.stderr.strip().splitlines()
    assert str(run.run_dir) in said and "has no config.yaml" in said and "earlier" not in said
    assert "nothing to resume" in run.stderr  # what the stopped launcher said
    assert alive(processes) == []
