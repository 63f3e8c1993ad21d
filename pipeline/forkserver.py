"""Workers forked from one process that has imported their code, so that a local run pays those imports once.

Importing a worker role's code (torch, transformers) costs 2.5-4 CPU-seconds in a process of its own, and a
local run starts four or five such processes on a machine that may have two cores; one process importing every
role's code costs ~4.5. The launcher starts this fork server first (`python -m pipeline.forkserver ROLE...`), so
its imports run while the launcher makes the broker, the model and config.yaml; each worker is then one request
line on the server's stdin, answered with the worker's pid on its stdout, and a restarted worker comes back
without its imports too.

A forked worker is what `asyncrl worker ROLE --config PATH` would be, to the launcher and to anyone looking:

- it is forked twice, the process between exiting at once, so the launcher (a child subreaper,
  PR_SET_CHILD_SUBREAPER) adopts it: the launcher waits for it and reads its exit code as for any child
  (`ForkedProcess`);
- once adopted it dies with the launcher (PR_SET_PDEATHSIG; set before the adoption, the re-parenting itself
  would send the signal), in a session of its own, its stdout and stderr in its log, stdin /dev/null;
- its command line (/proc/PID/cmdline: ps, the chaos harness and the CPU accounting read it) is the one it
  would have had, written into the server's own argument area, which the launcher makes long enough (the
  rest of that area reads as NUL bytes after it);
- it runs what `asyncrl worker` runs (`pipeline.roles.run_worker`, a config error one line and exit code 2, the
  objects left frozen as `pipeline.cli.run` leaves them), and exits through the interpreter's normal exit.

The server runs nothing but imports before it forks, and its children start with one thread (the one thread
torch's import starts, OpenBLAS's, is stopped by OpenBLAS itself at a fork). It keeps ~350 MB resident for the
run, which its children share until they write to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.roles import LAZY_IMPORTS, WORKER_MODULES, run_worker, worker_argv

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
ADOPTION_WAIT_S = 10.0  # a forked worker whose parent has not exited by then (it exits at once) gives up
REPLY_WAIT_S = 300.0  # the server answers once its imports are done: far longer means it is stuck
TITLE_ROOM = 96  # bytes of the server's argument area beyond its longest worker's command line


def prctl(option: int, value: int) -> None:
    if ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


class ForkedProcess:
    """A worker the server forked and this process adopted: the part of `subprocess.Popen` the launcher uses."""

    stdin = None

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped, its status lost (a stop raised between the two lines): as Popen
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N after signal N, as Popen says
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not reaped: the pid is still this worker's
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's end: the server started (this process made a child subreaper first), workers asked of it."""

    def __init__(self, roles: list[str], config_path: Path, log_path: Path) -> None:
        from topics.broker import die_with_parent

        prctl(PR_SET_CHILD_SUBREAPER, 1)
        room = max(len(" ".join(worker_argv(role, config_path))) for role in roles) + TITLE_ROOM
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pipeline.forkserver", *roles, " " * room],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                preexec_fn=die_with_parent,  # its workers are not its children: they go on
            )

    def fork(
        self, role: str, config_path: Path, log_path: Path, idle: bool = False, give_up: Callable[[], bool] = bool
    ) -> ForkedProcess | None:
        """A worker of `role`, or None where the server cannot make one (it ended, or took longer than REPLY_WAIT_S:
        start it another way) or `give_up()` became true while it was asked (a stop). Where it did not answer, the
        server is stopped, so that it forks nothing this launcher has not recorded."""
        if self.process.poll() is not None:
            return None
        request = {
            "role": role,
            "config": str(config_path),
            "log": str(log_path),
            "idle": idle,
            "launcher": os.getpid(),
        }
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # it ended
            return None
        deadline = time.monotonic() + REPLY_WAIT_S
        while not select.select([self.process.stdout], [], [], 0.05)[0]:  # its imports may not be done yet
            if give_up() or time.monotonic() > deadline:
                self.stop()  # a reply written meanwhile is still read below
                break
        reply = self.process.stdout.readline()
        return ForkedProcess(int(reply)) if reply.strip().isdigit() else None

    def stop(self) -> None:
        """Ended (it holds nothing: SIGTERM, even while it still imports) and reaped, once or again; the workers it
        made are not its children and go on."""
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        self.process.terminate()
        self.process.wait()


def reap_strays() -> None:
    """Zombie children of this process reaped: what it adopted as a subreaper (a dead worker's own children).
    Called once it has reaped every child it started, so that none of their statuses is taken."""
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):  # not a process, or gone
            continue
        if ppid == me and state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry.name), os.WNOHANG)


def serve(roles: list[str]) -> dict | None:
    """The server's loop: the roles' code imported, then a worker forked per request line. Returns in a forked
    worker only, with its request; in the server, None at the end of its stdin (the launcher is done)."""
    for role in roles:
        for module in (WORKER_MODULES[role], *LAZY_IMPORTS.get(role, ())):
            importlib.import_module(module)
    for line in sys.stdin:
        request = json.loads(line)
        read, write = os.pipe()
        between = os.fork()
        if between == 0:  # the process between: it forks the worker and exits, leaving it to the launcher
            between = os.getpid()
            try:
                worker = os.fork()
            except BaseException:
                os._exit(1)  # the server reads no pid: the launcher starts this worker another way
            if worker == 0:
                os.close(read)
                os.close(write)
                return {**request, "between": between}
            os.write(write, b"%d" % worker)
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            pid = pipe.read()
        os.waitpid(between, 0)  # its exit has handed the worker to the launcher
        sys.stdout.write(pid.decode() + "\n")
        sys.stdout.flush()
    return None


def become_worker(request: dict) -> int:
    """In the forked worker: adopted by the launcher, dying with it, logging to its file, named as it would
    be; then `asyncrl worker ROLE --config PATH`, its exit code returned."""
    from workers.cores import lower_priority

    deadline = time.monotonic() + ADOPTION_WAIT_S
    while os.getppid() == request["between"] and time.monotonic() < deadline:  # it is exiting
        time.sleep(0.001)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != request["launcher"]:  # the launcher died first (or is no subreaper): nothing to work for
        print(f"asyncrl: a forked {request['role']} worker's launcher is gone", file=sys.stderr)
        return 1
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for source, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(source, target)
    os.close(null)
    os.close(log)
    argv = worker_argv(request["role"], Path(request["config"]))
    set_command_line(argv)
    sys.argv = [str(Path(__file__).with_name("cli.py")), *argv[3:]]  # as `python -m pipeline.cli` sets it
    fresh_random_state()
    if request["idle"]:
        lower_priority()
    return run_as_worker(request["role"], request["config"])


def run_as_worker(role: str, config_path: str) -> int:
    """`asyncrl worker ROLE --config PATH` as `pipeline.cli.run` runs it: a config error is one line and exit code
    2; what the process holds is frozen out of the exit's garbage collections (~1 s of torch's objects)."""
    from pipeline.config import ConfigError

    try:
        run_worker(role, config_path, [])
    except ConfigError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2
    finally:
        gc.freeze()
    return 0


def fresh_random_state() -> None:
    """The draws of a fresh process, not the server's (Python's `random` reseeds itself after a fork): torch's
    default generator (seeded per process at import) and numpy's global one, where imported."""
    if torch := sys.modules.get("torch"):
        torch.seed()
    if numpy := sys.modules.get("numpy"):
        numpy.random.seed()


def set_command_line(argv: list[str]) -> None:
    """/proc/self/cmdline made `argv`: written over this process's argument area (arg_start..arg_end in
    /proc/self/stat), the rest of it zeroed; what does not fit is cut."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # from field 3 (state) on
    start, end = int(fields[45]), int(fields[46])  # fields 48 and 49
    text = b"\0".join(arg.encode() for arg in argv)[: end - start - 1]
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def main() -> int:
    request = serve(sys.argv[1:-1])  # the last argument is room for the workers' command lines
    return 0 if request is None else become_worker(request)


if __name__ == "__main__":
    sys.exit(main())
