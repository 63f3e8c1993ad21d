"""The warm sandbox's own failures (workers/sandbox/bwrap.py `Zygote`, `WarmPool`): a server killed or stopped
from outside costs at most the execution it was running, and is replaced; nothing of it is left. The attacks
of tests/integration/test_sandbox.py run against the warm sandbox too."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.sandbox.bwrap import WARM, Limits, run_python

pytestmark = pytest.mark.usefixtures("bubblewrap")


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before children."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(proc.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


@pytest.fixture(autouse=True)
def no_server_left() -> Iterator[None]:
    WARM.close()
    yield
    pids = [
        pid for server in WARM.idle for pid in (server.sandbox.process.pid, *descendants(server.sandbox.process.pid))
    ]
    WARM.close()
    time.sleep(0.1)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "a warm server's process was left"


def test_a_server_killed_while_idle_is_replaced():
    assert run_python("print(1)", warm=True).stdout == "1\n"
    (server,) = WARM.idle
    os.kill(server.sandbox.process.pid, signal.SIGKILL)  # bwrap: its sandbox dies with it
    server.sandbox.process.wait()
    done = run_python("print(2)", warm=True)
    assert (done.status, done.stdout) == ("ok", "2\n")
    assert [other.served for other in WARM.idle] == [1] and WARM.idle[0] is not server


def test_a_stopped_server_costs_its_execution_alone():
    assert run_python("pass", warm=True).status == "ok"
    (server,) = WARM.idle
    python = descendants(server.sandbox.process.pid)[1]  # below bwrap: the sandbox's pid 1, then the server
    os.kill(python, signal.SIGSTOP)  # its waiting child answers; the server never says it is done
    started = time.monotonic()
    done = run_python("print('answered')", limits=Limits(wall_s=1), warm=True)
    assert (done.status, done.reason) == ("killed", "the warm sandbox did not answer in time")
    assert 1 < time.monotonic() - started < 15
    assert WARM.idle == [] and server.sandbox.process.poll() is not None
    assert run_python("print(3)", warm=True).stdout == "3\n"


def test_a_server_that_dies_leaves_no_zombie():
    """The server's own death ends its bwrap, whose pid 1 is orphaned: this process, a child subreaper while it
    has servers, reaps it instead of the host's init (which in a container may reap nothing)."""
    assert run_python("pass", warm=True).status == "ok"
    (server,) = WARM.idle
    pids = [server.sandbox.process.pid, *descendants(server.sandbox.process.pid)]
    os.kill(pids[2], signal.SIGKILL)  # bwrap, the sandbox's pid 1, the server
    server.sandbox.process.wait()
    assert run_python("print(4)", warm=True).stdout == "4\n"  # a new server
    WARM.close()
    time.sleep(0.1)
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
