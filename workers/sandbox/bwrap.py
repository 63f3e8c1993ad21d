"""Untrusted Python (model-written code) in a bubblewrap sandbox: a throw-away bwrap per execution (cold), or a
fork of a kept bwrap's warm server in fresh namespaces per execution (warm).

`run_python(source, stdin, limits)` starts `bwrap` with every namespace of its own (user, mount, pid,
network, ipc, uts, cgroup), so the code has no network (not even the host's loopback), sees only its
own processes, and cannot signal anything outside; it cannot make user namespaces of its own. It sees a
read-only /usr (with the /bin, /lib*, /sbin links into it), a read-only /dev of device nodes, its own
/proc and the linker's cache, and nothing else: no /root, /home, /tmp or /etc, nor the caller's working
or run directory. Its one writable place is /sandbox/work, a fresh tmpfs of `limits.file_mb`, gone with
the sandbox. Its environment holds PATH, HOME and PWD alone (bwrap itself starts with an empty one, so
/proc/1/environ inside holds nothing of the caller's either).

When the caller is root, bwrap runs as `nobody` (65534): the code is an unprivileged user on the host
too, not host root in a user namespace (for which the kernel would not even count processes against
RLIMIT_NPROC). prlimit sets CPU seconds, address space, processes, file size and open files before
Python starts; the process count is per user namespace (Linux >= 5.14), so per execution. Where the host lets
it make a cgroup (workers/sandbox/cgroup.py), all the memory of an execution together is bounded by
`limits.memory_mb` too, files held in memfds, tmpfs and shared memory included (which the address-space limit
does not count): the kernel kills a process of it that would go over, and the execution is "memory". The caller
reads stdout and stderr up to `limits.output_bytes` each. When the program ends, at the wall-clock limit
or on overflow, it kills every process of the sandbox: the sandbox's pid 1, which takes every process of its
pid namespace with it, whether bwrap still runs or not (a program that writes into pid 1's memory through
/proc/1/mem can make bwrap exit early and pid 1 stay), and whatever is left in its cgroup. No daemon or double fork outlives its execution:
`run_python` returns once pid 1 is gone and reaped (see `Adoption`) and the cgroup is empty and removed, and
raises SandboxError if a process stays. A seccomp filter refuses the kernel keyring's calls, ptrace's and
other ABIs' (`seccomp_filter`).
Needs Linux >= 5.4 (pidfds) and bubblewrap >= 0.8 (--disable-userns, --size).

Warm (the default; ASYNCRL_SANDBOX=cold for a bwrap per execution): the same sandbox, one per execution running
at once in a process and kept for the process's life, holds a Python server (workers/sandbox/zygote.py) that
forks each execution a child in fresh mount, pid, ipc, net and uts namespaces of its own, with its own
/sandbox, /proc and working directory, no capabilities and the same rlimits: every property above holds
between executions too, and an execution costs a fork instead of bwrap's set-up and Python's start-up
(`asyncrl bench sandbox`: about 3-4 times the executions per second). What executions of one server share:
the user (RLIMIT_NPROC counts the server's three processes as well), the interpreter's memory as it was
before any request (the server never reads one), and the server's cgroup, whose memory bound is set before each
request to what the server holds then plus `limits.memory_mb`.
Calls are synchronous and independent: call `run_python` from many threads or processes at once.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import math
import os
import re
import select
import selectors
import shutil
import signal
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from workers.sandbox.cgroup import Cgroup
from workers.sandbox.zygote import HEADER as FRAME
from workers.sandbox.zygote import feed, write_frame

PACKAGE = "bubblewrap"  # Debian's (and Ubuntu's) package with /usr/bin/bwrap
NOBODY = 65534  # the code's user inside the sandbox, and on the host when the caller is root
PYTHONS = ("/usr/local/bin/python3", "/usr/bin/python3")  # the interpreter must live in the /usr the sandbox sees
PRLIMIT = "/usr/bin/prlimit"  # util-linux: sets the rlimits, then execs Python
SOURCE = "/sandbox/main.py"  # the program, read-only
SERVER = "/sandbox/server.py"  # the warm server (workers/sandbox/zygote.py), hidden from each execution
MODE_VARIABLE = "ASYNCRL_SANDBOX"  # 'cold': a bwrap of its own per execution; else warm (see `Zygote`)
WORKDIR = "/sandbox/work"  # the program's working directory and HOME: the only writable place
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # links into /usr, or directories
READ_CHUNK = 65536
MB = 1024 * 1024
BOUND_SLACK = 4 * MB  # a warm server's bound is set again once its own memory moved by more
ZYGOTE_GRACE_S = 5.0  # past an execution's wall-clock limit, before a silent warm server is given up
KILL_WAIT_S = 10.0  # for the kernel to empty a killed sandbox's pid namespace (milliseconds in practice)
PR_SET_CHILD_SUBREAPER = 36  # prctl option, linux/prctl.h
LIBC = ctypes.CDLL(None, use_errno=True)
CHILD_PID = re.compile(rb'"child-pid": *([0-9]+)[^0-9]')  # in what bwrap writes to --info-fd
Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
SOCK_FILTER = struct.Struct("=HBBI")  # code, jump if true, jump if false, k
# machine -> (AUDIT_ARCH_*, the numbers of add_key, request_key, keyctl, ptrace, process_vm_readv, process_vm_writev)
SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, (248, 249, 250, 101, 310, 311)),
    "aarch64": (0xC00000B7, (217, 218, 219, 117, 270, 271)),
}


class SandboxError(RuntimeError):
    """The host cannot run the sandbox (bwrap missing or refused): the caller's problem, not the program's."""


@dataclass(frozen=True)
class Limits:
    """What one execution may use; the defaults fit scoring a small function."""

    cpu_s: float = 2.0  # CPU seconds of each process (rounded up to whole seconds), then SIGXCPU
    wall_s: float = 5.0  # wall-clock seconds of the whole execution, then the sandbox is killed
    # address space of each process (RLIMIT_AS): Python raises MemoryError past it; and, where the host gives the
    # sandbox a cgroup, all the memory of the execution together (files in memfds and tmpfs included)
    memory_mb: int = 256
    processes: int = 16  # processes and threads of the sandbox's user, bwrap's pid 1 included
    file_mb: int = 16  # the largest file, and the whole working directory (its tmpfs)
    open_files: int = 64  # file descriptors per process
    output_bytes: int = 65536  # of stdout and of stderr each, then the sandbox is killed


@dataclass(frozen=True)
class Execution:
    """How one execution ended. `status`: ok, error (exception or non-zero exit), timeout (wall or CPU limit),
    memory (MemoryError), output_limit, or killed (by a signal); `reason` is one line, None when ok."""

    status: Status
    exit_code: int | None  # None when the sandbox was killed from outside (wall clock, output)
    stdout: str
    stderr: str
    reason: str | None
    seconds: float


def require_bwrap() -> str:
    """bwrap's path, once a trivial program ran in the sandbox; else SandboxError in one line naming the package.
    Cheap enough for pre-flight (one sandboxed `pass`)."""
    bwrap = find_bwrap()
    probe = run_python("", limits=Limits(wall_s=30.0))
    if probe.status != "ok":
        raise SandboxError(f"bwrap cannot run the sandbox here: {probe.reason}")
    return bwrap


def find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError(f"bwrap not found on PATH: install the package {PACKAGE} (apt-get install {PACKAGE})")
    return path


def find_python() -> str:
    """An interpreter under /usr, which the sandbox sees; a virtualenv's or pyenv's (under /root) it does not."""
    for path in PYTHONS:
        if os.access(path, os.X_OK) and os.path.realpath(path).startswith("/usr/"):
            return path
    raise SandboxError(f"no Python for the sandbox: none of {', '.join(PYTHONS)} (apt-get install python3)")


def run_python(source: str, stdin: str = "", limits: Limits = Limits(), warm: bool | None = None) -> Execution:
    """Run `source` as a Python program with `stdin` in a fresh sandbox; always returns, whatever the code does,
    once no process of the execution is left. `warm` (default: the environment's ASYNCRL_SANDBOX, warm unless
    it says cold) runs it in a child of a warm server (see `Zygote`) instead of a bwrap of its own. Raises
    SandboxError only when the sandbox itself cannot start; text that cannot run the same in both modes is an
    error without an execution (see `encoded`)."""
    try:
        program, data = encoded(source, stdin)
    except ValueError as refused:
        return Execution("error", None, "", "", str(refused), 0.0)
    if (warm if warm is not None else os.environ.get(MODE_VARIABLE, "warm") != "cold") and SECCOMP:
        return WARM.run(program, data, limits)
    bwrap, python = find_bwrap(), find_python()
    started = time.monotonic()
    with ADOPTION, Sandbox(bwrap, python, program, limits) as sandbox:
        stdout, stderr, ended = sandbox.communicate(data)
        out_of_memory = sandbox.cgroup is not None and sandbox.cgroup.oom_kills() > 0
    exit_code = None if ended else sandbox.process.returncode
    # bwrap's set-up failed (a program that writes such a line itself and exits 1 fails only its own execution)
    if exit_code == 1 and stderr.startswith((b"bwrap: ", b"sandbox: ")) and not stdout:
        raise SandboxError(f"{first_line(stderr)} (is the package {PACKAGE} working here?)")
    return execution(exit_code, stdout, stderr, ended, limits, started, out_of_memory)


def encoded(source: str, stdin: str) -> tuple[bytes, bytes]:
    """The program and its stdin in UTF-8; ValueError, in one line, for a lone surrogate in either (no UTF-8 holds
    one) or a NUL byte in the source (Python refuses a program with one; a cold one would be cut there)."""
    texts = []
    for name, text in (("source", source), ("stdin", stdin)):
        try:
            texts.append(text.encode())
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"the program's {name} is not Unicode text: a lone surrogate at character {exc.start}"
            ) from None
    if "\0" in source:
        raise ValueError(f"the program's source holds a NUL byte at character {source.index(chr(0))}")
    return texts[0], texts[1]


def execution(
    exit_code: int | None,
    stdout: bytes,
    stderr: bytes,
    ended: str | None,
    limits: Limits,
    started: float,
    out_of_memory: bool = False,
) -> Execution:
    status, reason = verdict(exit_code, stderr, ended, limits, out_of_memory)
    return Execution(status, exit_code, text(stdout), text(stderr), reason, round(time.monotonic() - started, 4))


def memfd(name: str, data: bytes) -> int:
    """An anonymous file holding `data`, read from its start."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Sandbox:
    """One bwrap process and its pipes, in a cgroup of its own where the host allows (`Cgroup`). Leaving the `with`
    kills every process of the sandbox, by handles no program can dodge (the pidfd of its pid namespace's pid 1,
    and its cgroup), and returns once none is left and pid 1 is reaped here."""

    def __init__(self, bwrap: str, python: str, source: bytes, limits: Limits, warm: bool = False):
        self.limits, self.info, self.pidfd, self.cgroup = limits, bytearray(), None, Cgroup.create()
        if self.cgroup is not None and not warm:  # a warm server's bound is set per request (`Zygote.run`)
            self.cgroup.limit_memory(limits.memory_mb * MB)
        program = memfd("sandbox-source", source)  # bwrap copies it into the sandbox before the code starts
        seccomp = memfd("sandbox-seccomp", SECCOMP)
        self.info_fd, info_write = os.pipe()  # bwrap writes the host pid of the sandbox's pid 1 here
        os.set_blocking(self.info_fd, False)
        # the sandbox goes first when memory runs out, in the group or on the host (a warm server's program raises
        # its own above the server's: `zygote.run_program`)
        gate, join = self.cgroup.gate(user(), 500 if warm else 1000) if self.cgroup is not None else ([], None)
        fds = (program, seccomp, info_write) if join is None else (program, seccomp, info_write, join)
        try:
            command = bwrap_command(bwrap, python, limits, program, info_write, warm)
            if SECCOMP:
                command[1:1] = ["--seccomp", str(seccomp)]
            self.process = start([*gate, *command], fds)
        except BaseException:
            os.close(self.info_fd)
            if self.cgroup is not None:
                self.cgroup.remove(KILL_WAIT_S)
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        """Kill what is left, whether bwrap still runs or not (a program that writes into the sandbox's pid 1 through
        /proc/1/mem can make bwrap exit early and keep pid 1 alive), and check that nothing is: SandboxError if a
        process stays."""
        try:
            self.read_info()  # bwrap may have named pid 1 since the last read (it does before the program starts)
            self.kill()
            if self.pidfd is not None:
                if not select.select([self.pidfd], [], [], KILL_WAIT_S)[0]:  # readable once pid 1, so all, is gone
                    raise SandboxError("the sandbox's pid 1 outlived a SIGKILL")
                with contextlib.suppress(ChildProcessError):  # bwrap reaped it itself
                    os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)  # an orphan adopted here
            if self.cgroup is not None and not self.cgroup.remove(KILL_WAIT_S):
                raise SandboxError(f"a process of the sandbox outlived a SIGKILL, in {self.cgroup.path}")
        finally:
            if self.pidfd is not None:
                os.close(self.pidfd)
            os.close(self.info_fd)
            for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
                pipe.close()

    def kill(self) -> None:
        """SIGKILL every process of the sandbox: its pid 1, whose end ends its whole pid namespace, what is left in
        its cgroup, and bwrap (its process group where bwrap does not end once pid 1 is gone, or has not named pid
        1 yet). Returns once bwrap is reaped."""
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(KILL_WAIT_S if self.pidfd is not None else 0)  # bwrap ends once pid 1 is gone
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def read_info(self) -> bool:
        """Read what bwrap says, without blocking; once it names the sandbox's pid 1, hold a pidfd on it (pids are
        handed out in turn, so the one just named is not another process's yet). False once bwrap closed it."""
        try:
            chunk = os.read(self.info_fd, READ_CHUNK)
        except BlockingIOError:
            return True
        self.info += chunk
        if self.pidfd is None and (found := CHILD_PID.search(self.info)):
            with contextlib.suppress(ProcessLookupError):  # already gone and reaped: nothing to wait for
                self.pidfd = os.pidfd_open(int(found[1]))
        return bool(chunk)

    def communicate(self, stdin: bytes) -> tuple[bytes, bytes, str | None]:
        """Feed stdin and read both outputs until they close: (stdout, stderr, None), or with 'timeout' or
        'output_limit' once the wall clock passes or an output outgrows its cap (`__exit__` then kills)."""
        process, cap = self.process, self.limits.output_bytes
        deadline = time.monotonic() + self.limits.wall_s
        outputs = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
        stdout, stderr = outputs.values()
        pending = memoryview(stdin)
        with selectors.DefaultSelector() as selector:
            for fd in (*outputs, self.info_fd):
                selector.register(fd, selectors.EVENT_READ)
            if pending:
                os.set_blocking(process.stdin.fileno(), False)
                selector.register(process.stdin.fileno(), selectors.EVENT_WRITE)
            else:
                process.stdin.close()
            while outputs.keys() & selector.get_map().keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    return bytes(stdout), bytes(stderr), "timeout"
                for key, _ in selector.select(left):
                    if key.fd == self.info_fd:
                        if not self.read_info():
                            selector.unregister(key.fd)
                    elif key.fd not in outputs:
                        pending = feed(key.fd, pending)
                        if not pending:
                            selector.unregister(key.fd)
                            process.stdin.close()
                    elif not (chunk := os.read(key.fd, READ_CHUNK)):
                        selector.unregister(key.fd)
                    elif len(outputs[key.fd]) + len(chunk) > cap:
                        outputs[key.fd] += chunk[: cap - len(outputs[key.fd])]
                        return bytes(stdout), bytes(stderr), "output_limit"
                    else:
                        outputs[key.fd] += chunk
        try:
            process.wait(max(0.0, deadline - time.monotonic()))  # outputs closed, yet it may still run
        except subprocess.TimeoutExpired:
            return bytes(stdout), bytes(stderr), "timeout"
        return bytes(stdout), bytes(stderr), None


class Zygote:
    """A warm server (workers/sandbox/zygote.py) in a sandbox built as a cold one is, with CAP_SYS_ADMIN in its own
    user namespace: for each execution it forks a child that takes fresh mount, pid, ipc, net and uts namespaces,
    its own /sandbox and working directory, and drops every capability before the program runs. An execution
    costs a fork instead of bwrap's set-up and Python's start-up; one at a time per server."""

    def __init__(self, bwrap: str, python: str):
        """Start the server and run `pass` in it: SandboxError, in one line, when it cannot serve here. This
        process is a child subreaper for the server's life (`Adoption`): its sandbox's pid 1 is reaped here
        whenever it ends."""
        server = (Path(__file__).parent / "zygote.py").read_bytes()
        ADOPTION.__enter__()
        try:
            self.sandbox = Sandbox(bwrap, python, server, Limits(), warm=True)
        except BaseException:
            ADOPTION.__exit__()
            raise
        self.stdin, self.stdout = self.sandbox.process.stdin.fileno(), self.sandbox.process.stdout.fileno()
        self.served = -1  # executions answered, the probe not counted
        self.oom_kills, self.memory_bound = 0, 0  # of the server's cgroup, before the request under way
        try:
            probe = self.run(b"", b"", Limits(wall_s=30.0))
        except ZygoteLost as lost:
            self.close()
            raise SandboxError(f"{lost} (is the package {PACKAGE} working here? ASYNCRL_SANDBOX=cold)") from None
        if probe[0] != 0:
            self.close()
            raise SandboxError(f"the warm sandbox cannot run Python here: {first_line(probe[2], last=True)}")

    def run(self, source: bytes, stdin: bytes, limits: Limits) -> tuple[int | None, bytes, bytes, str | None]:
        """(exit code, stdout, stderr, ended) as `Sandbox.communicate` and bwrap give them; ZygoteLost when the
        server does not answer in time (the caller then closes it)."""
        header = {**asdict(limits), "cpu": max(1, math.ceil(limits.cpu_s))}
        cgroup = self.sandbox.cgroup
        if cgroup is not None:  # the server's memory as it is now, and the execution's on top
            bound = cgroup.memory_used() + limits.memory_mb * MB
            if abs(bound - self.memory_bound) > BOUND_SLACK:
                cgroup.limit_memory(bound)
                self.memory_bound = bound
        try:
            write_frame(self.stdin, header, source, stdin)
        except OSError as exc:
            raise ZygoteLost(f"the warm sandbox took no request: {exc}") from exc
        deadline = time.monotonic() + limits.wall_s + ZYGOTE_GRACE_S
        answer = json.loads(self.read(FRAME.unpack(self.read(FRAME.size, deadline))[0], deadline))  # as read_frame
        stdout, stderr = (self.read(size, deadline) for size in answer["sizes"])
        self.read(1, deadline)  # the server's word that the execution's last process is gone
        self.served += 1
        return answer["exit_code"], stdout, stderr, answer["ended"]

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the server's cgroup for memory since the last time it was asked
        (after the last execution)."""
        if self.sandbox.cgroup is None:
            return False
        before, self.oom_kills = self.oom_kills, self.sandbox.cgroup.oom_kills()
        return self.oom_kills > before

    def read(self, size: int, deadline: float) -> bytes:
        data = bytearray()
        while len(data) < size:
            if not select.select([self.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise ZygoteLost("the warm sandbox did not answer in time")
            if not (chunk := os.read(self.stdout, size - len(data))):
                raise ZygoteLost(f"the warm sandbox ended: {self.error()}")
            data += chunk
        return bytes(data)

    def error(self) -> str:
        """The server's last words (its stderr), without blocking."""
        stderr = self.sandbox.process.stderr.fileno()
        os.set_blocking(stderr, False)
        with contextlib.suppress(BlockingIOError):
            return first_line(os.read(stderr, READ_CHUNK), last=True) or "no reason given"
        return "no reason given"

    def close(self) -> None:
        """End the server (and with it any execution) and return once none of its processes is left."""
        try:
            self.sandbox.__exit__()
        finally:
            ADOPTION.__exit__()


class ZygoteLost(RuntimeError):
    """A warm server that stopped answering: closed, and the execution reported as killed."""


class WarmPool:
    """This process's warm servers: one per execution running at once, kept between executions. They start in a
    thread of their own that lives as long as the process: bwrap's --die-with-parent follows the thread that
    started it, and the threads calling `run` may be short-lived. A forked child starts a pool of its own."""

    def __init__(self) -> None:
        self.lock, self.idle, self.starter = threading.Lock(), [], None

    def run(self, source: bytes, stdin: bytes, limits: Limits) -> Execution:
        started = time.monotonic()
        zygote = self.take()
        try:
            exit_code, stdout, stderr, ended = zygote.run(source, stdin, limits)
        except ZygoteLost as lost:
            out_of_memory = zygote.out_of_memory()  # the kernel may have killed the server itself
            zygote.close()
            if out_of_memory:
                return execution(None, b"", b"", None, limits, started, out_of_memory)
            return Execution("killed", None, "", "", str(lost), round(time.monotonic() - started, 4))
        except BaseException:
            zygote.close()
            raise
        out_of_memory = zygote.out_of_memory()
        with self.lock:
            self.idle.append(zygote)
        return execution(exit_code, stdout, stderr, ended, limits, started, out_of_memory)

    def take(self) -> Zygote:
        """An idle server that still runs, or a new one."""
        with self.lock:
            while self.idle:
                zygote = self.idle.pop()
                if zygote.sandbox.process.poll() is None:
                    return zygote
                zygote.close()  # ended meanwhile (killed from outside): reaped, and replaced
            if self.starter is None:
                self.starter = ThreadPoolExecutor(1, thread_name_prefix="sandbox-starter")
        return self.starter.submit(Zygote, find_bwrap(), find_python()).result()

    def close(self) -> None:
        """End every idle server (`run`s under way keep theirs and put it back)."""
        with self.lock:
            idle, self.idle = self.idle, []
        for zygote in idle:
            zygote.close()


class Adoption:
    """Executions under way in this process, which is a child subreaper while there are any. bwrap exits as soon
    as the program does, and its pid 1 in the sandbox, killed then by --die-with-parent, is orphaned: it comes here
    to be reaped (`Sandbox.__exit__`) instead of to the host's init as a zombie, which in a container whose init
    reaps nothing would pile up, one per execution. Off again once none runs: other orphans are not this
    process's business. The flag is the process's, hence a count across threads."""

    def __init__(self) -> None:
        self.lock, self.running = threading.Lock(), 0

    def __enter__(self) -> None:
        with self.lock:
            if self.running == 0:
                subreaper(True)
            self.running += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.running -= 1
            if self.running == 0:
                subreaper(False)


def subreaper(on: bool) -> None:
    if LIBC.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise SandboxError(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")


ADOPTION = Adoption()
WARM = WarmPool()
os.register_at_fork(after_in_child=ADOPTION.__init__)  # a forked child is no subreaper, and runs nothing yet
os.register_at_fork(after_in_child=WARM.__init__)  # nor does it share its parent's servers
atexit.register(WARM.close)


def seccomp_filter(machine: str | None = None) -> bytes:
    """A seccomp program (struct sock_filter[], what bwrap's --seccomp loads) that answers ENOSYS to the kernel
    keyring's calls, to ptrace's and to every call of another ABI (i386, x32: numbers it does not check), and
    lets everything else through. Keyrings are the one thing the namespaces do not separate between the
    executions of a warm server (their user keyring is the server's user namespace's), and the keys' quota is
    the host user's (nobody's) in either mode. ptrace and the calls that read or write another process's memory
    would let a cold program take over the sandbox's pid 1 (/proc/1/mem still can, which is why the sandbox's
    end does not rely on bwrap: `Sandbox.kill`). Empty on a machine whose call numbers it does not know (warm mode is
    then off)."""
    machine = machine or os.uname().machine
    if machine not in SECCOMP_ARCHES:
        return b""
    arch, calls = SECCOMP_ARCHES[machine]
    deny = SECCOMP_RET_ERRNO | 38  # ENOSYS: as if the kernel had no keyrings
    program = [
        (BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (BPF_JEQ_K, 1, 0, arch),
        (BPF_RET_K, 0, 0, deny),
        (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (BPF_JGE_K, len(calls) + 1, 0, 0x40000000),  # x32's calls (x86-64 numbers with bit 30 set)
        *((BPF_JEQ_K, len(calls) - i, 0, call) for i, call in enumerate(calls)),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_RET_K, 0, 0, deny),
    ]
    return b"".join(SOCK_FILTER.pack(*instruction) for instruction in program)


SECCOMP = seccomp_filter()


def system_binds() -> list[str]:
    """/usr read-only, and /bin, /lib... as they are on the host: links into /usr, or read-only directories."""
    arguments = ["--ro-bind", "/usr", "/usr"]
    for path in SYSTEM_LINKS:
        if os.path.islink(path):
            arguments += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            arguments += ["--ro-bind", path, path]
    return [*arguments, "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]


def bwrap_command(bwrap: str, python: str, limits: Limits, program: int, info: int, warm: bool = False) -> list[str]:
    """The bwrap command line: namespaces, file system, environment, then prlimit and Python; or, `warm`, the warm
    server (workers/sandbox/zygote.py) as `program`, with the one capability it needs to isolate executions."""
    mb = 1024 * 1024
    cpu = max(1, math.ceil(limits.cpu_s))
    files = ["--dir", WORKDIR] if warm else ["--perms", "0700", "--size", str(limits.file_mb * mb), "--tmpfs", WORKDIR]
    sandbox = [
        *("--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"),
        *("--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox"),
        *(("--cap-add", "CAP_SYS_ADMIN") if warm else ("--cap-drop", "ALL")),
        *system_binds(),
        *("--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"),  # device nodes work; no files on its tmpfs
        *("--perms", "0444", "--ro-bind-data", str(program), SERVER if warm else SOURCE),
        *files,
        *("--remount-ro", "/", "--chdir", WORKDIR, "--clearenv", "--info-fd", str(info)),
        *("--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", WORKDIR),
    ]
    if warm:
        return [bwrap, *sandbox, "--", python, "-I", SERVER]
    rlimits = [
        f"--cpu={cpu}:{cpu + 1}",  # SIGXCPU at the soft limit, SIGKILL a second later
        f"--as={limits.memory_mb * mb}",
        f"--nproc={limits.processes}",
        f"--fsize={limits.file_mb * mb}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]
    return [bwrap, *sandbox, "--", PRLIMIT, *rlimits, "--", python, "-I", SOURCE]


def start(command: list[str], fds: tuple[int, ...]) -> subprocess.Popen:
    """bwrap in a process group of its own, with an empty environment, as `nobody` when the caller is root
    (Popen sets user, group and groups in C after fork: no preexec_fn, safe beside threads)."""
    as_root = os.geteuid() == 0
    try:
        return subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            cwd="/",
            pass_fds=fds,
            process_group=0,
            user=NOBODY if as_root else None,
            group=NOBODY if as_root else None,
            extra_groups=[] if as_root else None,
        )
    except OSError as exc:
        raise SandboxError(f"cannot start bwrap: {exc} (install the package {PACKAGE})") from exc


def user() -> int:
    """The sandbox's user on the host: nobody when the caller is root, else the caller."""
    return NOBODY if os.geteuid() == 0 else os.geteuid()


def verdict(
    exit_code: int | None, stderr: bytes, ended: str | None, limits: Limits, out_of_memory: bool = False
) -> tuple[Status, str | None]:
    """(status, one-line reason) of an execution; `out_of_memory` when the kernel killed a process of it for going
    over its cgroup's memory bound."""
    if ended == "timeout":
        return "timeout", f"ran past the wall-clock limit of {limits.wall_s:g} s and was killed"
    if ended == "output_limit":
        return "output_limit", f"wrote more than {limits.output_bytes} bytes to stdout or stderr and was killed"
    if out_of_memory:  # a process of it, maybe not the program's first, killed by the kernel
        return "memory", f"held more than the memory limit of {limits.memory_mb} MB in all and was killed"
    if exit_code == 0:
        return "ok", None
    last = first_line(stderr, last=True)
    if exit_code == 128 + signal.SIGXCPU:
        return "timeout", f"ran past the CPU limit of {max(1, math.ceil(limits.cpu_s))} s (SIGXCPU)"
    if last.startswith("MemoryError"):
        return "memory", f"ran past the memory limit of {limits.memory_mb} MB: {last}"
    if exit_code > 128 and exit_code - 128 in signal.valid_signals():
        return "killed", f"killed by {signal.Signals(exit_code - 128).name}"
    return "error", last or f"exit code {exit_code}"


def first_line(output: bytes, last: bool = False) -> str:
    """The first (or last) non-empty line of an output, at most 300 characters: a reason in one line."""
    lines = [line.strip() for line in text(output).splitlines() if line.strip()]
    if not lines:
        return ""
    return (lines[-1] if last else lines[0])[:300]


def text(output: bytes) -> str:
    return output.decode("utf-8", errors="replace")
