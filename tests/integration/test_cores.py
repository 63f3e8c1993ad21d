"""A process's scheduling class as the evaluator's is set and given back: on a real process and its threads."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.cores import lower_priority, restore_priority


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or os.geteuid() != 0, reason="leaving SCHED_IDLE takes root")
def test_an_idle_process_and_all_its_threads_get_the_normal_policy_back() -> None:
    """The evaluator once the workers stopped: an idle-class process waits behind any busy one, anyone's (an
    unprivileged user may not leave SCHED_IDLE without an RLIMIT_NICE of 20: it stays there, nothing raised)."""
    threaded = "import threading, time; [threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(3)]"
    process = subprocess.Popen([sys.executable, "-c", f"{threaded}; time.sleep(60)"], preexec_fn=lower_priority)
    try:
        threads = Path(f"/proc/{process.pid}/task")
        while len(list(threads.iterdir())) < 4:
            time.sleep(0.01)
        assert {os.sched_getscheduler(int(t.name)) for t in threads.iterdir()} == {os.SCHED_IDLE}

        restore_priority(process.pid)

        assert {os.sched_getscheduler(int(t.name)) for t in threads.iterdir()} == {os.SCHED_OTHER}
    finally:
        process.kill()
        process.wait()
    restore_priority(process.pid)  # gone: nothing to do, nothing raised
