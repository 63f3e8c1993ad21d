"""The launcher's workers are forked from a server that imported their code (`pipeline.forkserver`): each one is
the launcher's own child, named, logged, exiting and dying with the launcher as `asyncrl worker ROLE` would.

The launcher here is a small script in a process of its own (it makes itself a child subreaper, which this test
process must not become). Its worker reads its config from a FIFO: it stays blocked there, alive, until the test
writes one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

from pipeline.forkserver import worker_argv

LAUNCHER = """
import json, sys, time
from pathlib import Path
from pipeline.forkserver import ForkServer
tmp, then = Path(sys.argv[1]), sys.argv[2]
server = ForkServer(["reward"], tmp / "config.yaml", tmp / "forkserver.log")
worker = server.fork("reward", tmp / "config.yaml", tmp / "reward-1.stdout")
print(json.dumps({"worker": worker.pid, "server": server.process.pid}), flush=True)
if then == "wait":
    print(worker.wait(120), flush=True)
    server.stop()
    print(server.process.returncode, flush=True)
else:
    time.sleep(600)
"""
GIVING_UP = """
import json, sys
from pathlib import Path
from pipeline.forkserver import ForkServer
tmp = Path(sys.argv[1])
server = ForkServer(["reward"], tmp / "config.yaml", tmp / "forkserver.log")
asked = server.fork("reward", tmp / "config.yaml", tmp / "reward-1.stdout", give_up=lambda: True)
again = server.fork("reward", tmp / "config.yaml", tmp / "reward-1.stdout")
print(json.dumps([asked is None, server.process.returncode, again is None]))
"""


def launch(tmp_path: Path, then: str) -> tuple[subprocess.Popen, dict]:
    os.mkfifo(tmp_path / "config.yaml")  # a worker opening it waits for a writer
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), then], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    return launcher, json.loads(launcher.stdout.readline())


def status(pid: int) -> dict[str, str]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    return {"state": fields[0], "ppid": fields[1], "sid": fields[3], "cmdline": [arg.decode() for arg in cmdline]}


def named(pid: int, argv: list[str], within_s: float = 10.0) -> dict[str, str]:
    """Its status once its command line is `argv` (it names itself once its session and log are set up)."""
    deadline = time.monotonic() + within_s
    while (now := status(pid))["cmdline"] != argv and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if status(pid)["state"] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_worker_is_the_launchers_child_named_logged_and_exiting_as_asyncrl_worker(tmp_path: Path) -> None:
    launcher, pids = launch(tmp_path, "wait")
    try:
        argv = worker_argv("reward", tmp_path / "config.yaml")
        worker = named(pids["worker"], argv)
        assert worker["cmdline"] == argv  # what ps, the chaos harness and the CPU accounting read
        assert worker["ppid"] == str(launcher.pid)  # adopted: the launcher reaps it and reads its exit code
        assert worker["sid"] == str(pids["worker"])  # a session of its own, as a started worker has
        (tmp_path / "config.yaml").write_text("trainer:\n  steps: many\n")  # the worker reads it now
        assert launcher.stdout.readline().strip() == "2"  # a config error, as `asyncrl worker` exits with it
        assert launcher.stdout.readline().strip() in ("0", "-15")  # the server ended, reaped
        assert launcher.wait(30) == 0
    finally:
        launcher.kill()
    log = (tmp_path / "reward-1.stdout").read_text()
    assert "trainer.steps" in log and str(tmp_path / "config.yaml") in log


def test_a_sigkilled_launcher_takes_its_forked_worker_and_its_server_with_it(tmp_path: Path) -> None:
    launcher, pids = launch(tmp_path, "sleep")
    try:
        assert named(pids["worker"], worker_argv("reward", tmp_path / "config.yaml"))["ppid"] == str(launcher.pid)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    assert gone(pids["worker"], within_s=10) and gone(pids["server"], within_s=10)


def test_a_failed_preparation_stops_the_fork_server_and_starts_no_worker(tmp_path: Path) -> None:
    """A config error found while preparing (the server importing meanwhile): the server is stopped and reaped."""
    script = f"""
import msgspec
from pathlib import Path
from pipeline.launch import local_run
from pipeline.config import ConfigError, resolve
from schemas.config import RunConfig

def failing_prepare(config, progress):
    raise ConfigError("data.reward: no such function")

local_run.prepare = failing_prepare
tmp = Path({str(tmp_path)!r})
config = resolve(msgspec.convert({{"runs_dir": str(tmp), "broker": {{"bootstrap": "127.0.0.1:9"}}}}, RunConfig))
run = local_run.LocalRun(msgspec.structs.replace(config, name="run"), tmp / "run")
with local_run.StopSignals() as stops:
    try:
        run.start(stops, eval_rows=None, progress=False)
    except ConfigError:
        run.stop()
print(len(run.workers), run.forks.process.returncode)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() in (["0", "0"], ["0", "-15"])  # no worker; the server ended (SIGTERM) and reaped


def test_the_launcher_reaches_its_fork_server_without_torch() -> None:
    """What `run_locally` imports before the fork server starts (a raw template: a chat template's check loads the
    tokenizer): with torch among them, the launcher's imports would come before the workers'."""
    modules = (
        "pipeline.launch.local_run",
        "pipeline.monitor",
        "workers.evaluator.rows",
        "workers.evaluator.worker",
        "workers.rows",
    )
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"


def test_a_fork_given_up_stops_the_server_so_that_it_forks_nothing_unrecorded(tmp_path: Path) -> None:
    """A stop while the server is asked (here, still importing): no worker, the server stopped and reaped, and a
    later request is not sent to it (the launcher would start that worker as `asyncrl worker`)."""
    out = subprocess.run(
        [sys.executable, "-c", GIVING_UP, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == [True, -signal.SIGTERM, True]
    assert not (tmp_path / "reward-1.stdout").exists()


def test_a_process_s_entry_leaves_what_it_holds_out_of_the_exit_s_collections() -> None:
    """`asyncrl` and `python -m pipeline.cli` end through `cli.run` (a forked worker through
    `forkserver.run_as_worker`), which freezes the objects left (the interpreter's last collections would walk
    torch's and transformers' code: ~1 s per process)."""
    probe = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))\n"
        "from pipeline.cli import run\n"
        "run(['run', '--help'])\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "frozen True", done.stderr
    [script] = [entry for entry in entry_points(group="console_scripts") if entry.name == "asyncrl"]
    assert script.value == "pipeline.cli:run"
