"""The CPU sampler of `bench pipeline`: roles from command lines, and cores read from real processes."""

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
        10: (1, 5, "python -m pipeline.cli bench pipeline"),
        11: (10, 7, "python -m pipeline.cli worker reward --config c.yaml"),
        12: (11, 3, "python -c from multiprocessing.spawn import spawn_main"),  # a scorer
        13: (10, 2, "tansu broker --storage-engine memory://tansu/"),
        99: (1, 50, "python -m pipeline.cli worker trainer"),  # not below the root
    }
    assert ticks_by_role(10, table) == {10: ("monitor", 5), 11: ("reward", 7), 12: ("reward", 3), 13: ("broker", 2)}


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
