"""The leftover scan of `asyncrl chaos` on a real process: a stray one is found and killed."""

from __future__ import annotations

import os
import subprocess

import pytest

from pipeline.chaos import procs


@pytest.mark.timeout(30)
def test_a_process_left_behind_is_found_and_killed() -> None:
    stray = subprocess.Popen(["sleep", "60"])
    try:
        seen = {pid: proc for pid, proc in procs.descendants(os.getpid()).items() if pid == stray.pid}
        assert list(seen) == [stray.pid] and "sleep 60" in seen[stray.pid].cmdline
        found = procs.leftovers(seen, (), grace_s=0.5)
        assert [p.pid for p in found] == [stray.pid]
        procs.kill_all(found)
        assert stray.wait(5) == -9 and procs.alive(seen) == []
    finally:
        stray.kill()
        stray.wait()
