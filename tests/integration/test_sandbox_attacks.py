"""Attacks on the sandbox (workers/sandbox/bwrap.py) that once got through, each in both modes: a program that
outlives its execution, odd text that broke the host's side, and memory that the address-space limit does not
count. The fixtures are test_sandbox.py's: every test runs cold and warm, and nothing of an execution may be
left after it."""

from __future__ import annotations

import platform
import secrets
import threading
import time

import pytest
from test_sandbox import mode, nothing_left_behind, sandbox_processes  # noqa: F401 (fixtures)

from workers.sandbox.bwrap import Limits, run_python
from workers.sandbox.cgroup import Cgroup
from workers.sandbox.code import code_reward, extract_code
from workers.tasks import load_task

pytestmark = pytest.mark.usefixtures("bubblewrap")

# Rewrites the code where the sandbox's pid 1 (bwrap's init, cold) returns from wait4, through /proc/1/mem
# (which seccomp cannot refuse): pid 1 clears its parent-death signal, tells bwrap that the program exited
# (bwrap then exits), and pauses for ever; a daemon of the program's stays with it.
ESCAPE = """\
import os, struct, subprocess
subprocess.Popen(["/usr/bin/python3", "-c", "import time; time.sleep(120)  # MARKER"], stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
pc = int(open("/proc/1/syscall").read().split()[-1], 16)
eventfd = next(int(fd) for fd in os.listdir("/proc/1/fd") if "eventfd" in os.readlink(f"/proc/1/fd/{fd}"))
code = (
    b"\\xbf\\x01\\x00\\x00\\x00\\x31\\xf6\\xb8\\x9d\\x00\\x00\\x00\\x0f\\x05"  # prctl(PR_SET_PDEATHSIG, 0)
    + b"\\x6a\\x01\\x48\\x89\\xe6\\xbf" + struct.pack("<I", eventfd)  # write(eventfd, &1, 8): bwrap exits
    + b"\\xba\\x08\\x00\\x00\\x00\\xb8\\x01\\x00\\x00\\x00\\x0f\\x05"
    + b"\\xb8\\x22\\x00\\x00\\x00\\x0f\\x05\\xeb\\xf7"  # pause() for ever
)
with open("/proc/1/mem", "r+b", buffering=0) as mem:
    mem.seek(pc)
    mem.write(code)
print("pid 1 patched")
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the attack's machine code is x86-64's")
def test_a_program_that_takes_over_pid_1_does_not_outlive_its_execution():
    marker = f"asyncrl-escape-{secrets.token_hex(8)}"
    limits = Limits(wall_s=4.0)
    done = run_python(ESCAPE.replace("MARKER", marker), limits=limits)
    assert done.seconds < limits.wall_s + 2.0
    assert [process for process in sandbox_processes() if marker in process] == []


@pytest.mark.parametrize(
    ("source", "stdin", "reason"),
    [
        ("print('a')  # \ud800", "", "source is not Unicode text: a lone surrogate at character 14"),
        ("print(input())", "\udcff\n", "stdin is not Unicode text: a lone surrogate at character 0"),
        ("print('a')\0print('b')", "", "source holds a NUL byte at character 10"),
    ],
)
def test_odd_text_is_an_error_result_the_same_in_both_modes(source, stdin, reason):
    done = run_python(source, stdin, Limits(wall_s=4.0))
    assert (done.status, done.exit_code, done.stdout, done.stderr) == ("error", None, "", "")
    assert done.reason == f"the program's {reason}"


def test_a_surrogate_in_a_completion_scores_0_without_an_exception():
    completion = "```python\ndef f():\n    return '\udc80'\n```"
    assert code_reward("", completion, {"tests": "assert f() == 1"})[0] == 0.0
    assert code_reward("", completion, {"inputs": '["\\udc80"]', "outputs": '["1"]'})[0] == 0.0


def test_the_program_runs_from_its_bytes_in_both_modes_coding_line_included():
    done = run_python("# -*- coding: latin-1 -*-\nprint(len('\u00e9'))", limits=Limits(wall_s=4.0))
    assert (done.status, done.stdout) == ("ok", "2\n")  # é in UTF-8, read as Latin-1: two characters


@pytest.mark.parametrize("opening", ["```", "```\t", "```python"])
def test_extracting_code_after_a_fence_and_64000_blanks_takes_linear_time(opening):
    started = time.process_time()
    assert extract_code(opening + " \t" * 32000) == opening.strip()
    assert extract_code(opening + " " * 64000 + "\nx = 1") == "x = 1"
    assert time.process_time() - started < 0.2


def test_ptrace_is_refused():
    program = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    program += "print(libc.ptrace(0, 0, None, None), ctypes.get_errno())  # PTRACE_TRACEME"
    done = run_python(program, limits=Limits(wall_s=4.0))
    assert (done.status, done.stdout) == ("ok", "-1 38\n")  # ENOSYS, from the seccomp filter


AREA_TEST = "assert abs(area(2) - 12.566) < 1e-3"
FAKE_VALUES = [
    # a value whose every operation gives itself back, and whose repr is a pass
    "class Zero:\n    __sub__ = __rsub__ = __abs__ = lambda self, *other: self\n    __repr__ = lambda self: '0'\n"
    "def area(r):\n    return Zero()\n",
    # repr itself replaced, for every value of the process
    "import builtins\nbuiltins.repr = lambda value: '0'\ndef area(r):\n    return 1.0\n",
    # the harness's lines printed by the program, each saying 0, before it leaves
    "import os, sys\njob = sys.modules['__main__'].job\n"
    "for i, _ in enumerate(job['probes']):\n    print(job['marker'], i, 'ok', 0)\nsys.stdout.flush()\nos._exit(0)",
    # a float that says it equals anything
    "class Near(float):\n    __lt__ = __eq__ = lambda self, other: True\ndef area(r):\n    return Near(0)\n",
]


@pytest.mark.parametrize("program", FAKE_VALUES)
def test_an_assert_with_the_expected_value_inside_cannot_be_faked(program):
    assert code_reward("", program, {"tests": AREA_TEST})[0] == 0.0
    assert code_reward("", "def area(r):\n    return 3.14159 * r * r\n", {"tests": AREA_TEST})[0] == 1.0


@pytest.mark.parametrize("program", [p.replace("area(r)", "f(x)") for p in FAKE_VALUES])
def test_the_code_task_scores_a_faked_value_0(program):
    task = load_task("code")
    problem = next(p for p in task.split(0, 200)[0] if p.prompt == "add 3, times 2\n")
    assert task.score(program, problem.answer) == 0.0
    assert task.score("def f(x):\n    return 2 * x + 6", problem.answer) == 1.0


# 4 processes, each holding 240 MB in memfds (files in memory, which RLIMIT_AS does not count): 960 MB in all
HOARDER = """\
import os
for _ in range(3):
    if os.fork() == 0:
        break
files = [os.memfd_create("hoard") for _ in range(15)]
for fd in files:
    os.write(fd, b"1" * (16 * 1024 * 1024 - 4096))  # each below the file-size limit
print("held 240 MB", flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""
MEMORY_MARGIN_MB = 64  # over the limit: the sampling's step, and the host's other shared memory moving meanwhile


def shared_memory() -> int:
    """Bytes of shared memory (memfds, tmpfs, /dev/shm) on the host: where a memfd's pages are counted."""
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("Shmem:"))


def cgroups_here() -> bool:
    group = Cgroup.create()
    return group is not None and group.remove(timeout_s=1.0)


@pytest.mark.skipif(not cgroups_here(), reason="needs cgroups: root and a writable cgroup file system")
def test_memory_held_in_files_is_bounded_for_the_whole_execution():
    limits = Limits(wall_s=20.0, memory_mb=256)
    before, peak, done_event = shared_memory(), [0], threading.Event()

    def sample() -> None:
        while not done_event.wait(0.002):
            peak[0] = max(peak[0], shared_memory() - before)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        done = run_python(HOARDER, limits=limits)
    finally:
        done_event.set()
        sampler.join()
    assert (done.status, done.reason) == ("memory", "held more than the memory limit of 256 MB in all and was killed")
    assert peak[0] < (limits.memory_mb + MEMORY_MARGIN_MB) * 1024 * 1024, f"{peak[0] >> 20} MB"
    assert shared_memory() - before < MEMORY_MARGIN_MB * 1024 * 1024  # all given back
