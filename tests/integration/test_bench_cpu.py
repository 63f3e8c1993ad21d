"""The CPU sampler of `bench pipeline`: roles from command lines, and cores read from real processes."""

import resource
import subprocess
import sys
import time

from pipeline.bench.cpu import CpuSampler, role_of, ticks_by_role


def test_roles_from_command_lines():
    assert role_of("/usr/bin/python3 -m pipeline.cli worker rollout --config c.yaml") == "rollout"
    assert role_of("/x/tansu broker --storage-engine memory://tansu/") == "broker"
    assert role_of("python -c from multiprocessing.spawn import spawn_main") == "other"


def test_children_count_towards_their_role():
    table = {
        10: (1, 5, 40, "python -m pipeline.cli bench pipeline"),  # 40: workers it reaped, counted as themselves
        11: (10, 7, 0, "python -m pipeline.cli worker reward --config c.yaml"),
        12: (11, 3, 6, "python -c from multiprocessing.spawn import spawn_main"),  # a scorer: 6 for its sandboxes
        13: (10, 2, 0, "tansu broker --storage-engine memory://tansu/"),
        99: (1, 50, 0, "python -m pipeline.cli worker trainer"),  # not below the root
    }
    assert ticks_by_role(10, table) == {10: ("monitor", 5), 11: ("reward", 7), 12: ("reward", 9), 13: ("broker", 2)}


def test_an_ended_unreaped_process_keeps_its_role():
    table = {10: (1, 5, 0, "python bench"), 11: (10, 7, 0, ""), 12: (10, 3, 0, "")}  # both ended, not reaped
    assert ticks_by_role(10, table, known={11: "rollout"}) == {10: ("monitor", 5), 11: ("rollout", 7), 12: ("other", 3)}


def test_a_worker_that_ended_still_counts_as_its_role():
    """Its command line is empty between its end and its reaping, the window's last samples in a bench."""
    spin = "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"
    with CpuSampler(interval_s=0.2) as cpu:
        child = subprocess.Popen([sys.executable, "-c", spin, "worker", "trainer"])
        time.sleep(2.0)  # it ends after ~1 s and stays unreaped meanwhile
        child.wait()
    assert cpu.totals[-1].get("trainer", 0.0) > 0.5  # was filed under "other" (beside other tests' processes)


def test_short_lived_children_are_counted_through_their_parent():
    """Processes that start and end between two samples (sandboxed executions) still count, and only once."""
    burst = "import subprocess, sys\nfor _ in range(40): subprocess.run([sys.executable, '-c', 'sum(range(300000))'])"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with CpuSampler(interval_s=0.2) as cpu:
        subprocess.run([sys.executable, "-c", burst, "worker", "reward"])
        time.sleep(0.5)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime  # the burst and its children
    assert 0.6 * spent < cpu.totals[-1]["reward"] < 1.1 * spent


def test_a_busy_child_uses_more_cores_than_a_sleeping_one():
    spin = "import time, sys\nend = time.time() + 2.5\nwhile time.time() < end: pass"
    rest = "import time\ntime.sleep(2.5)"
    with CpuSampler(interval_s=0.2) as cpu:
        children = [
            subprocess.Popen([sys.executable, "-c", spin, "worker", "trainer"]),
            subprocess.Popen([sys.executable, "-c", rest, "worker", "rollout"]),
        ]
        started = time.time()
        for child in children:
            child.wait()
        ended = time.time()
    cores = cpu.cores(started + 0.5, ended)  # after the interpreters started
    # relative, not absolute: on cores shared with other work the spinning child may get a fraction of one
    assert cores["trainer"] > 0.1 and cores["trainer"] > 5 * cores.get("rollout", 0.0)
