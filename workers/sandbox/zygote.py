"""The warm sandbox's server: a Python that runs inside one bwrap sandbox and forks a fresh, isolated child per
execution, so an execution skips bwrap's set-up and the interpreter's start-up. Standard library only: it
runs under the sandbox's own /usr Python, which sees nothing of this project (workers/sandbox/bwrap.py hands
it this file's text, as it hands a cold sandbox the program's).

Its bwrap is the cold sandbox's (no network, read-only system, no home, run or working directory, its own
user namespace as nobody, no further user namespaces), plus CAP_SYS_ADMIN in that namespace, which the server
needs to give each execution namespaces of its own. One execution at a time, never overlapping:

    server (never reads a request itself, so holds nothing of any execution)
      └ one fork per request: reads it, unshares mount, pid, ipc, net and uts namespaces, mounts a fresh
        tmpfs on the working directory, then feeds stdin, reads both outputs up to their cap, kills at the
        wall-clock limit or on overflow, and writes the response
          └ pid 1 of the new pid namespace: mounts that namespace's /proc, drops every capability, waits for
            the program and exits with its status, which ends every process left in the namespace
              └ the program: stdin and outputs on pipes, no other file descriptor, in the fresh directory,
                under the rlimits, without capabilities (no-new-privs: an exec cannot bring them back)

So each execution has its own files (its tmpfs dies with its mount namespace), its own processes (no pid of
another execution or of the server is reachable, /proc shows its own), its own System V IPC and loopback, and
nothing of it outlives it. What they share: the user, whose process count (RLIMIT_NPROC) includes the
server's three processes, and the warm interpreter's memory as it was before the first request.

Frames both ways: 4-byte big-endian length, a JSON header, then the raw byte strings it gives the sizes of.
The host side imports `feed` and `write_frame` from here: one definition for both sides of the pipes.
"""

import ast
import builtins
import collections
import contextlib
import ctypes
import fractions
import functools
import itertools
import json
import math
import os
import re
import resource
import select
import signal
import struct
import sys
import time
import traceback
import types

# Imported once here, so that programs importing them start at once: what the code reward's harness and the
# Python tool use, and what small solutions commonly do.
PRELOADED = (ast, collections, fractions, functools, itertools, math, re)
LIBC = ctypes.CDLL(None, use_errno=True)
NAMESPACES = 0x00020000 | 0x20000000 | 0x08000000 | 0x40000000 | 0x04000000  # CLONE_NEW{NS,PID,IPC,NET,UTS}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
CAPABILITY_VERSION_3 = 0x20080522
SOURCE = "/sandbox/main.py"  # the program's name in tracebacks, as in a cold sandbox
WORKDIR = "/sandbox/work"  # the program's working directory and HOME, as in a cold sandbox
SERVER_PROCESSES = 3  # the server, the request's child and the namespace's pid 1: what a cold sandbox lacks
READ_CHUNK = 65536
HEADER = struct.Struct(">I")
DONE = b"\0"


def main() -> None:
    """A child per request, forked before the request comes, until the host closes stdin (the child that finds
    it closed says so). After each answer, one byte more once that child is gone and the next one waits: the
    host then knows that nothing of the execution is left."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    child = spawn()
    while True:
        _, status = os.waitpid(child, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            return
        child = spawn()
        os.write(1, DONE)


def spawn() -> int:
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a program that stops reading its stdin: EPIPE, as Python has
        os._exit(serve_one())
    return child


def serve_one() -> int:
    """One request: 0 once answered, 3 when stdin closed, 70 when this side failed (the host then stops it)."""
    try:
        check(LIBC.unshare(NAMESPACES), "unshare")  # before the request comes
        request = read_frame(0)
        if request is None:
            return 3
        header, source, stdin = request
        fresh_files(source, header["file_mb"])
        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr
        init = os.fork()
        if init == 0:
            os._exit(pid_one(header, source, [pipes[0][0], pipes[1][1], pipes[2][1]]))
        for fd in (pipes[0][0], pipes[1][1], pipes[2][1]):
            os.close(fd)
        deadline = time.monotonic() + header["wall_s"]
        stdout, stderr, ended = communicate(
            pipes[0][1], pipes[1][0], pipes[2][0], stdin, header["output_bytes"], deadline
        )
        if not ended and not exits_by(init, deadline):  # its outputs closed, yet it may still run
            ended = "timeout"
        if ended:
            os.kill(init, signal.SIGKILL)  # pid 1: the kernel ends its whole namespace with it
        _, status = os.waitpid(init, 0)  # returns once the namespace is empty
        code = None if ended else os.waitstatus_to_exitcode(status)
        write_frame(1, {"exit_code": code, "ended": ended}, stdout, stderr)
        return 0
    except BaseException:
        traceback.print_exc()
        return 70


def exits_by(pid: int, deadline: float) -> bool:
    """Whether child `pid` exits before `deadline` (a pidfd turns readable when it does)."""
    pidfd = os.pidfd_open(pid)
    try:
        return bool(select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0])
    finally:
        os.close(pidfd)


def fresh_files(source: bytes, file_mb: int) -> None:
    """/sandbox as a cold sandbox has it, in this execution's mount namespace: the program, read-only, as
    main.py (over the server's file), and an empty working directory of `file_mb`."""
    tmpfs, flags = b"tmpfs", MS_NOSUID | MS_NODEV
    check(LIBC.mount(tmpfs, b"/sandbox", tmpfs, flags, b"size=" + str(len(source) + 65536).encode()), "mount")
    with open(SOURCE, "wb") as file:
        file.write(source)
    os.chmod(SOURCE, 0o444)
    os.mkdir(WORKDIR, 0o700)
    check(LIBC.mount(None, b"/sandbox", None, MS_REMOUNT | MS_RDONLY | flags, None), "remount /sandbox")
    size = f"size={file_mb * 1024 * 1024},mode=0700".encode()
    check(LIBC.mount(tmpfs, WORKDIR.encode(), tmpfs, flags, size), "mount the working directory")


def pid_one(header: dict, source: bytes, fds: list[int]) -> int:
    """The namespace's init: its own /proc, no capabilities, then the program's exit status (128 + a signal)."""
    try:
        check(LIBC.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount proc")
        drop_privileges()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the program may signal its pid 1: no KeyboardInterrupt here
        program = os.fork()
        if program == 0:
            run_program(header, source, fds)
        os.closerange(0, 1 << 20)  # the host's pipes too: nothing but waiting is left to do here
        while True:  # orphans of the program come here too
            pid, status = os.waitpid(-1, 0)
            if pid == program:
                return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    except BaseException:
        traceback.print_exc()
        return 70


def run_program(header: dict, source: bytes, fds: list[int]) -> None:
    """Become the program: its pipes as fds 0-2 and nothing else open, its directory, its limits; never returns."""
    LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc/self is its own again (pid 1 stays hidden)
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as file:
        file.write("1000")  # the first to go when memory runs out, not the server
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh Python has it
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, 1 << 20)
    os.chdir(WORKDIR)
    mb, cpu = 1024 * 1024, header["cpu"]
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at the soft limit, SIGKILL a second later
        (resource.RLIMIT_AS, header["memory_mb"] * mb),
        (resource.RLIMIT_NPROC, header["processes"] + SERVER_PROCESSES),
        (resource.RLIMIT_FSIZE, header["file_mb"] * mb),
        (resource.RLIMIT_NOFILE, header["open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, value if isinstance(value, tuple) else (value, value))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the program's, for its lifetime)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    sys.argv = [SOURCE]
    os._exit(execute(source))


def execute(source: bytes) -> int:
    """Run the program as `python main.py` would (its bytes, as the file's: a coding line or BOM counts), as
    __main__: its exit status."""
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(__file__=SOURCE, __builtins__=builtins)
    sys.modules["__main__"] = main_module
    try:
        exec(compile(source, SOURCE, "exec"), main_module.__dict__)  # the sandboxed program
        code = 0
    except SystemExit as exc:
        code = exit_status(exc.code)
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # without this function's frame
        code = 1
    try:
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = code or 120  # as Python exits when it cannot flush
    return code


def exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def drop_privileges() -> None:
    """No capability from here on, none regained by any exec (no-new-privs), and not ptrace-able by the program."""
    check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    check(LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")
    header = struct.pack("=Ii", CAPABILITY_VERSION_3, 0)
    check(LIBC.capset(header, bytes(24)), "capset")  # effective, permitted, inheritable: all empty


def communicate(stdin_fd: int, stdout_fd: int, stderr_fd: int, stdin: bytes, cap: int, deadline: float):
    """Feed stdin, read both outputs until they close: (stdout, stderr, None), or 'timeout' / 'output_limit'."""
    outputs = {stdout_fd: bytearray(), stderr_fd: bytearray()}
    poller = select.poll()
    for fd in outputs:
        poller.register(fd, select.POLLIN)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(stdin_fd, False)
        poller.register(stdin_fd, select.POLLOUT)
    else:
        os.close(stdin_fd)
    open_outputs = set(outputs)
    while open_outputs:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(outputs[stdout_fd]), bytes(outputs[stderr_fd]), "timeout"
        for fd, _ in poller.poll(left * 1000):
            if fd == stdin_fd:
                pending = feed(fd, pending)
                if not pending:
                    poller.unregister(fd)
                    os.close(fd)
            elif not (chunk := os.read(fd, READ_CHUNK)):
                poller.unregister(fd)
                open_outputs.discard(fd)
            elif len(outputs[fd]) + len(chunk) > cap:
                outputs[fd] += chunk[: cap - len(outputs[fd])]
                return bytes(outputs[stdout_fd]), bytes(outputs[stderr_fd]), "output_limit"
            else:
                outputs[fd] += chunk
    return bytes(outputs[stdout_fd]), bytes(outputs[stderr_fd]), None


def feed(fd: int, pending: memoryview) -> memoryview:
    """Write what the pipe takes of `pending`; what is left (nothing once the reader closed its end)."""
    try:
        return pending[os.write(fd, pending[:READ_CHUNK]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        return pending[:0]


def read_frame(fd: int):
    """(header, *byte strings) of the next frame, or None at end of input."""
    prefix = read_exact(fd, HEADER.size)
    if prefix is None:
        return None
    header = json.loads(read_exact(fd, HEADER.unpack(prefix)[0]))
    return header, *(read_exact(fd, size) for size in header["sizes"])


def read_exact(fd: int, size: int):
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            if data:
                raise EOFError("the frame was cut short")
            return None
        data += chunk
    return bytes(data)


def write_frame(fd: int, header: dict, *blobs: bytes) -> None:
    encoded = json.dumps({**header, "sizes": [len(blob) for blob in blobs]}).encode()
    data = memoryview(b"".join([HEADER.pack(len(encoded)), encoded, *blobs]))
    while data:
        data = data[os.write(fd, data) :]


def check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


if __name__ == "__main__":
    main()
