"""The sandbox for model-written code (workers/sandbox/bwrap.py) against real attacks.

Each attack runs as an untrusted program would, and fails with its reason; the calling process keeps its
files, its environment and its helper processes; and after every test no process of any execution is left
(`nothing_left_behind`: none of the sandbox's host user, nobody, none running bwrap or the sandboxed program),
and this process can still fork. bwrap comes from the `bubblewrap` fixture (tests/conftest.py); `make system-deps`
installs Debian's package.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import resource
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from workers.sandbox.bwrap import (
    MODE_VARIABLE,
    NOBODY,
    SOURCE,
    WARM,
    WORKDIR,
    Limits,
    SandboxError,
    require_bwrap,
    run_python,
)

ADD_KEY = {"x86_64": 248, "aarch64": 217}  # the add_key call, which the sandbox's seccomp filter refuses
SERVER_PROCESSES = 4  # host processes of an idle warm server: bwrap, the sandbox's pid 1, the server, its next child

pytestmark = pytest.mark.usefixtures("bubblewrap")
SECRET = "asyncrl-sandbox-secret-7f3a9c51"
FAST = Limits(wall_s=4.0)
PR_GET_CHILD_SUBREAPER = 37  # prctl option, linux/prctl.h
REFUSED = r"(Read-only file system|No such file or directory|Permission denied)"


def sandbox_processes() -> set[str]:
    """'pid command' of every host process of the sandbox's user (nobody, when this process is root), or running
    bwrap or a sandboxed program; zombies included."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            uid = int(re.search(r"\nUid:\s+(\d+)", (proc / "status").read_text())[1])
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, TypeError):
            continue  # gone meanwhile
        if (os.geteuid() == 0 and uid == NOBODY) or SOURCE in command or "bwrap" in command:
            found.add(f"{proc.name} {command}")
    return found


@pytest.fixture(autouse=True, params=["cold", "warm"])
def mode(request, monkeypatch) -> str:
    """Every attack against both: a bwrap of its own per execution, and a warm server's fork."""
    monkeypatch.setenv(MODE_VARIABLE, request.param)
    return request.param


@pytest.fixture(autouse=True)
def nothing_left_behind(mode) -> Iterator[None]:
    WARM.close()  # the servers of earlier calls (the `bubblewrap` fixture's check)
    before = sandbox_processes()
    yield
    servers = len(WARM.idle)  # an idle warm server's processes hold nothing of an execution
    assert len(sandbox_processes() - before) == SERVER_PROCESSES * servers, "a process outlived its execution"
    WARM.close()
    assert sandbox_processes() - before == set(), "a process of the sandbox outlived its execution"
    assert subprocess.run(["/bin/true"]).returncode == 0  # the caller can still fork and exec
    flag = ctypes.c_int()
    assert ctypes.CDLL(None).prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0
    assert flag.value == 0, "the caller stayed a child subreaper after its executions"


@pytest.fixture
def helper() -> Iterator[subprocess.Popen]:
    """A process of the test's own, outside the sandbox, with the secret in its environment."""
    process = subprocess.Popen(["sleep", "60"], env={"ASYNCRL_SECRET": SECRET})
    yield process
    assert process.poll() is None, "the sandboxed program reached a process outside"
    process.kill()
    process.wait()


def test_prints_both_outputs_and_exits_zero():
    done = run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (done.status, done.exit_code, done.stdout, done.stderr, done.reason) == ("ok", 0, "out\n", "err\n", None)
    assert 0 < done.seconds < FAST.wall_s


def test_stdin_reaches_the_program_even_when_larger_than_a_pipe():
    numbers = " ".join(str(n) for n in range(100_000))  # 590 kB; a pipe holds 64 kB
    done = run_python("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin=numbers)
    assert (done.status, done.stdout) == ("ok", f"{sum(range(100_000))}\n")


def test_a_non_zero_exit_is_an_error_with_its_code():
    done = run_python("import sys\nsys.exit(3)")
    assert (done.status, done.exit_code, done.reason) == ("error", 3, "exit code 3")


def test_an_exception_is_an_error_with_the_last_traceback_line():
    done = run_python("def f():\n    return 1 / 0\n\nf()")
    assert (done.status, done.exit_code, done.reason) == ("error", 1, "ZeroDivisionError: division by zero")
    assert done.stderr.startswith("Traceback")


def test_the_program_runs_as_nobody_with_an_empty_environment_in_a_directory_of_its_own(monkeypatch):
    monkeypatch.setenv("ASYNCRL_SECRET", SECRET)
    program = (
        "import json, os, socket\nopen('kept', 'w').write('here')\n"
        "print(json.dumps([os.getuid(), os.getgid(), socket.gethostname(), os.getcwd(), open('kept').read(), "
        "dict(os.environ)]))"
    )
    done = run_python(program)
    uid, gid, host, cwd, content, env = json.loads(done.stdout)
    assert (uid, gid, host, cwd, content) == (NOBODY, NOBODY, "sandbox", WORKDIR, "here")
    assert env.keys() - {"LC_CTYPE"} == {"PATH", "HOME", "PWD"} and env["HOME"] == env["PWD"] == WORKDIR


def test_require_bwrap_finds_a_working_bwrap(bubblewrap):
    assert require_bwrap() == bubblewrap


def test_a_missing_bwrap_is_one_line_naming_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap there
    for call in (require_bwrap, lambda: run_python("print('never runs')")):
        with pytest.raises(SandboxError) as error:
            call()
        assert "\n" not in str(error.value) and "bubblewrap" in str(error.value)


def test_no_connection_to_a_listener_on_the_hosts_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=2)"
        done = run_python(program, limits=FAST)
        assert done.status == "error"
        assert re.fullmatch(r"\w+Error: \[Errno \d+\] (Connection refused|Network is unreachable)", done.reason)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing arrived


def test_no_name_lookup():
    done = run_python("import socket\nsocket.getaddrinfo('example.com', 443)", limits=FAST)
    assert done.status == "error" and done.reason.startswith("socket.gaierror: ")


def test_a_fork_bomb_meets_the_process_limit():
    program = """\
import os, sys, time
main, error = os.getpid(), None
end = time.monotonic() + 1.0
while time.monotonic() < end:
    try:
        os.fork()  # parent and child alike fork on
    except OSError as exc:
        error = exc
if os.getpid() != main:
    time.sleep(60)  # the bomb's processes stay; the sandbox ends them with the main one
sys.exit(f"{sum(name.isdigit() for name in os.listdir('/proc'))} processes, then: {error}")
"""
    done = run_python(program, limits=FAST)
    assert done.status == "error"
    processes, error = re.fullmatch(r"(\d+) processes, then: (.*)", done.reason).groups()
    assert int(processes) <= FAST.processes and error == "[Errno 11] Resource temporarily unavailable"


def test_a_memory_bomb_meets_the_memory_limit():
    done = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(16 * 1024 * 1024))", limits=FAST)
    assert (done.status, done.reason) == ("memory", f"ran past the memory limit of {FAST.memory_mb} MB: MemoryError")


def test_an_endless_loop_meets_the_cpu_limit():
    done = run_python("while True:\n    pass", limits=Limits(cpu_s=1, wall_s=20))
    assert (done.status, done.reason) == ("timeout", "ran past the CPU limit of 1 s (SIGXCPU)")


def test_sleeping_past_the_wall_clock_limit_is_killed():
    done = run_python("import time\ntime.sleep(60)", limits=Limits(wall_s=1))
    assert (done.status, done.exit_code) == ("timeout", None)
    assert done.reason == "ran past the wall-clock limit of 1 s and was killed" and done.seconds < 3


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_100_mb_of_output_is_cut_at_the_cap_and_killed(stream):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    program = f"import sys\nchunk = 'x' * 1_000_000\nfor _ in range(100):\n    sys.{stream}.write(chunk)"
    done = run_python(program, limits=FAST)
    assert done.status == "output_limit" and getattr(done, stream) == "x" * FAST.output_bytes
    assert done.reason == f"wrote more than {FAST.output_bytes} bytes to stdout or stderr and was killed"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # kB: the 100 MB never came here


@pytest.mark.parametrize(
    ("program", "error"),
    [
        ("open('big', 'wb').write(bytes(32 * 1024 * 1024))", "[Errno 27] File too large"),  # one file past file_mb
        (
            "for n in range(64):\n    open(f'f{n}', 'wb').write(bytes(1024 * 1024))",
            "[Errno 28] No space left on device",
        ),
    ],
)
def test_filling_the_working_directory_meets_its_size(program, error):
    done = run_python(program, limits=FAST)
    assert done.status == "error" and done.reason == f"OSError: {error}"


@pytest.mark.parametrize("where", ["/tmp", "/usr", "/", "/sandbox", "/dev", "/dev/shm", "cwd", "run_dir"])
def test_nothing_is_written_outside_its_directory(where, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    directory = {"cwd": os.getcwd(), "run_dir": str(run_dir)}.get(where, where)
    target = Path(directory, f"asyncrl-sandbox-{os.getpid()}")
    done = run_python(f"open({str(target)!r}, 'w').write('written')", limits=FAST)
    assert done.status == "error" and re.search(REFUSED, done.reason), done.reason
    assert not target.exists() and not Path(os.path.normpath(target)).exists()


@pytest.mark.parametrize("what", ["run_key", "run_dir", "/root", "home", "cwd_file", "/etc/shadow"])
def test_the_run_directory_home_and_host_files_cannot_be_read(what, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.key").write_text(SECRET)
    paths = {"run_key": run_dir / "run.key", "run_dir": run_dir, "home": Path.home(), "cwd_file": Path("x").absolute()}
    path = str(paths.get(what, what))
    done = run_python(f"import os\np = {path!r}\nprint(os.listdir(p) if os.path.isdir(p) else open(p).read())")
    assert done.status == "error" and re.search(REFUSED, done.reason), done.reason
    assert SECRET not in done.stdout + done.stderr


def test_other_processes_environments_never_reach_the_program(monkeypatch, helper):
    monkeypatch.setenv("ASYNCRL_SECRET", SECRET)
    program = f"""\
import os
seen = sorted(int(name) for name in os.listdir('/proc') if name.isdigit())
print('pids', seen)
for pid in [1, {os.getpid()}, {os.getppid()}, {helper.pid}, *seen, 'self']:
    for name in ('environ', 'cmdline'):
        try:
            print(pid, name, open(f'/proc/{{pid}}/{{name}}', 'rb').read())
        except OSError as exc:
            print(pid, name, type(exc).__name__)
"""
    done = run_python(program, limits=FAST)
    assert done.status == "ok" and SECRET not in done.stdout + done.stderr
    assert re.search(r"^pids \[1, 2\]$", done.stdout, re.M)  # bwrap's pid 1 and the program: nothing else
    for pid in (os.getpid(), os.getppid(), helper.pid):
        assert f"\n{pid} environ FileNotFoundError\n" in done.stdout


def test_processes_outside_cannot_be_signalled(helper):
    program = f"""\
import os, signal
for pid in (-1, {os.getpid()}, {os.getppid()}):  # -1: every process it may signal but pid 1 and itself
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as exc:
        print(pid, type(exc).__name__)
os.kill({helper.pid}, signal.SIGKILL)
"""
    done = run_python(program, limits=FAST)
    assert (done.status, done.reason) == ("error", "ProcessLookupError: [Errno 3] No such process")
    assert done.stdout == "".join(f"{pid} ProcessLookupError\n" for pid in (-1, os.getpid(), os.getppid()))
    # `helper` asserts that it still lives; this process obviously does


def test_a_daemon_does_not_outlive_its_execution():
    program = """\
import os, subprocess, time
subprocess.Popen(['sleep', '300'], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(300)  # a double-forked daemon, holding stdout open
    os._exit(0)
print('daemonized')
"""
    done = run_python(program, limits=Limits(wall_s=20))
    assert (done.status, done.stdout) == ("ok", "daemonized\n")
    assert done.seconds < 5  # its outputs closed when the program ended: the daemons went with it
    assert not any("sleep 300" in process for process in sandbox_processes())


def test_two_executions_cannot_see_or_touch_each_other():
    hidden = SECRET[::-1]  # neither source holds the secret itself: a search must not find its own program
    first = f"""\
import os, time
open('mine', 'w').write({hidden!r}[::-1])
time.sleep(2)
print(open('mine').read(), sorted(int(name) for name in os.listdir('/proc') if name.isdigit()))
"""
    second = f"""\
import os, signal, time
time.sleep(0.5)  # the first has written its file by now
found = []
for root, dirs, files in os.walk('/'):
    if root in ('/proc', '/usr', '/dev'):
        dirs[:] = []
        continue
    for name in files:
        try:
            if {hidden!r}[::-1] in open(os.path.join(root, name), errors='replace').read():
                found.append(os.path.join(root, name))
        except OSError:
            pass
for pid in range(3, 32768):  # every pid but 1 and its own (2)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print('found', found)
"""
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_python, program, "", Limits(wall_s=10)) for program in (first, second)]
        first_done, second_done = (run.result() for run in runs)
    assert (first_done.status, first_done.stdout) == ("ok", f"{SECRET} [1, 2]\n")
    assert (second_done.status, second_done.stdout) == ("ok", "found []\n")


LEAVER = """\
import ctypes, os, signal, socket, subprocess, sys
token = sys.stdin.read()
open('left', 'w').write(token)
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
segment = libc.shmget(0x5EED, 4096, 0o1666)  # IPC_CREAT
ctypes.memmove(libc.shmat(segment, None, 0), token.encode(), len(token))
libc.syscall.restype = ctypes.c_long
key = libc.syscall(ADD_KEY, b'user', b'asyncrl-left', token.encode(), len(token), -4)  # to the user keyring
print('key', key, ctypes.get_errno())
listener = socket.socket(socket.AF_UNIX)
listener.bind('\\0asyncrl-left')
listener.listen()
subprocess.Popen(['sleep', '300'], start_new_session=True)
for pid in range(1, 4096):
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
print('left', segment >= 0)
"""
FINDER = """\
import ctypes, os, re, socket, sys
given = sys.stdin.read()  # empty; the control run gives it the secret, which the search must then find
libc = ctypes.CDLL(None, use_errno=True)
found = {'files': os.listdir('.'), 'shm': libc.shmget(0x5EED, 0, 0), 'processes': os.listdir('/proc').count('3')}
try:
    socket.socket(socket.AF_UNIX).connect('\\0asyncrl-left')
    found['socket'] = 'connected'
except OSError as exc:
    found['socket'] = type(exc).__name__
pattern, memory = re.compile(rb'zq[a-y]{24}qz'), open('/proc/self/mem', 'rb')
found['memory'] = []
for line in open('/proc/self/maps'):
    span, perms = line.split()[:2]
    start, end = (int(n, 16) for n in span.split('-'))
    if perms.startswith('r'):
        try:
            memory.seek(start)
            found['memory'] += [m.group().decode() for m in pattern.finditer(memory.read(end - start))]
        except (OSError, OverflowError, ValueError):
            pass
print(found)
"""


def test_an_execution_leaves_nothing_for_the_next():
    """Run after run in one warm server (and in two cold sandboxes): the second finds no file, memory, System V
    IPC object, socket or process of the first, which tried to leave each, and tried to end the server."""
    secret = "zq" + "".join(chr(ord("a") + n % 25) for n in os.urandom(24)) + "qz"  # [a-y], never in a source
    control = run_python(FINDER, stdin=secret, limits=Limits(wall_s=10))
    assert control.status == "ok" and secret in control.stdout, control.reason
    leaver = LEAVER.replace("ADD_KEY", str(ADD_KEY[platform.machine()]))
    first_done = run_python(leaver, stdin=secret, limits=Limits(wall_s=10))
    second_done = run_python(FINDER, limits=Limits(wall_s=10))
    assert (first_done.status, first_done.stdout) == ("ok", "key -1 38\nleft True\n"), first_done.reason  # ENOSYS
    assert second_done.status == "ok", second_done.reason
    expected = {"files": [], "shm": -1, "processes": 0, "socket": "ConnectionRefusedError", "memory": []}
    assert second_done.stdout == f"{expected}\n"
    if os.environ[MODE_VARIABLE] == "warm":
        assert [server.served for server in WARM.idle] == [3]  # all three ran in one server, which lived on


def test_a_program_that_stops_reading_its_input_ends_normally():
    """Its stdin's writer meets a closed pipe (EPIPE), which ends neither the sandbox nor a warm server."""
    done = run_python("print(input())", stdin="first\n" + "y" * 300_000, limits=FAST)
    assert (done.status, done.stdout) == ("ok", "first\n"), done.reason
    assert run_python("print('next')").stdout == "next\n"


def test_closing_both_outputs_does_not_escape_the_wall_clock():
    done = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)", limits=Limits(wall_s=1))
    assert (done.status, done.reason) == ("timeout", "ran past the wall-clock limit of 1 s and was killed")
    assert done.seconds < 3


def test_signalling_its_own_pid_1_ends_nothing_but_its_own_execution():
    done = run_python("import os, signal\nfor s in (signal.SIGINT, signal.SIGTERM):\n    os.kill(1, s)\nprint('here')")
    assert (done.status, done.stdout) == ("ok", "here\n")
    assert run_python("print('next')").stdout == "next\n"
