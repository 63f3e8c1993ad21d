"""A cgroup per sandbox: the handle that ends every process of an execution, whatever the program did to its
parents, and the bound on the memory it holds (files in memfds, tmpfs and shared memory included, which the
address-space limit does not count).

The sandbox's processes join the group before bwrap starts (`GATE`): whatever they fork, however they
detach from bwrap, stays in it. `kill` writes the cgroup v2 `cgroup.kill` (Linux >= 5.14), which SIGKILLs every
member at once, forks under way included; `remove` returns once the group is empty and gone. The memory bound
is the v2 `memory.max` where the group has the memory controller, else the v1 memory hierarchy's
`memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`, so that no swap goes past it).

Creating cgroups needs root (or a delegated subtree) and a writable cgroup file system: `Cgroup.create` returns
None where neither hierarchy can be used, and the sandbox then ends an execution through its pid namespace
alone (killing the namespace's pid 1 ends everyone in it), with no memory bound beyond the rlimits.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path

PREFIX = "asyncrl-sandbox-"  # then the creating process's pid and a count
NAMES = itertools.count()
POLL_S = 0.002  # between two looks at a group that is being emptied


class Cgroup:
    """One group, as a directory in each hierarchy used: the v2 one (`cgroup.kill`, and `memory.max` when it has
    the memory controller) and the v1 memory one when v2 has no memory controller here."""

    def __init__(self, unified: Path | None, memory_v1: Path | None):
        self.unified, self.memory_v1 = unified, memory_v1
        self.directories = [path for path in (unified, memory_v1) if path is not None]

    @classmethod
    def create(cls) -> Cgroup | None:
        """A new, empty group beside this process's own, or None where no hierarchy can be written here."""
        if os.geteuid() != 0:
            return None
        name = f"{PREFIX}{os.getpid()}-{next(NAMES)}"
        unified, memory_v1 = (make(parent / name) if parent is not None else None for parent in HIERARCHIES)
        if unified is not None and not (unified / "cgroup.kill").exists():  # Linux < 5.14: no use
            unified = remove_directory(unified)
        if unified is not None and (unified / "memory.max").exists():  # v2 holds the memory bound too
            memory_v1 = remove_directory(memory_v1)
        return cls(unified, memory_v1) if unified or memory_v1 else None

    def add(self, pid: int) -> None:
        """Move process `pid` into the group (before it forks: see `GATE`)."""
        for path in self.directories:
            write(path / "cgroup.procs", pid)

    def limit_memory(self, limit: int) -> None:
        """Bound the memory of the group's processes to `limit` bytes, swap included (none past it); the kernel's
        OOM killer ends a process of the group that would go over."""
        if self.unified is not None and (self.unified / "memory.max").exists():
            write(self.unified / "memory.max", limit)
            with contextlib.suppress(FileNotFoundError):  # no swap accounting here
                write(self.unified / "memory.swap.max", 0)
        elif self.memory_v1 is not None:
            swap = self.memory_v1 / "memory.memsw.limit_in_bytes"
            if swap.exists():
                write(swap, -1)  # memory + swap may never be below memory alone: lift it, then bound both
            write(self.memory_v1 / "memory.limit_in_bytes", limit)
            if swap.exists():
                write(swap, limit)

    def memory_used(self) -> int:
        """Bytes charged to the group now (0 without a memory bound)."""
        for path in (
            self.unified and self.unified / "memory.current",
            self.memory_v1 and self.memory_v1 / "memory.usage_in_bytes",
        ):
            if path is not None and path.exists():
                return int(path.read_text())
        return 0

    def oom_kills(self) -> int:
        """How many processes of the group the kernel killed for going over its memory bound."""
        for path in (
            self.unified and self.unified / "memory.events",
            self.memory_v1 and self.memory_v1 / "memory.oom_control",
        ):
            if path is not None and path.exists():
                counts = dict(line.split() for line in path.read_text().splitlines())
                return int(counts.get("oom_kill", "0"))
        return 0

    def kill(self) -> None:
        """SIGKILL every process of the group at once (v2); without v2, the caller kills through the pid namespace."""
        if self.unified is not None:
            write(self.unified / "cgroup.kill", 1)

    def remove(self, timeout_s: float) -> bool:
        """Wait until no process is left in the group, then remove it; False when one still is at `timeout_s`
        (the group is then kept, to be seen)."""
        deadline = time.monotonic() + timeout_s
        while any((path / "cgroup.procs").read_text().strip() for path in self.directories):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        for path in self.directories:
            while True:
                try:
                    path.rmdir()
                    break
                except OSError:  # EBUSY while the kernel finishes with the last member
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(POLL_S)
        return True


# Put before a command: a shell that waits for a line on its stdin, then execs the command with the rest of it.
# The caller moves the shell into the group (`Cgroup.add`) before it writes that line: the command's first
# instruction already runs in the group. (A shell has no other way in: it cannot name a descriptor above 9.)
GATE = ["/bin/sh", "-c", 'read -r _ && exec "$@"; echo "sandbox: not let into its cgroup" >&2; exit 1', "sh"]


def make(path: Path) -> Path | None:
    try:
        path.mkdir()
    except OSError:  # read-only, not permitted, or the controller refuses another group
        return None
    return path


def remove_directory(path: Path | None) -> None:
    """Remove a group that is of no use (None, for the caller to hold instead)."""
    if path is not None:
        with contextlib.suppress(OSError):
            path.rmdir()


def write(path: Path, value: int) -> None:
    with open(path, "w") as file:
        file.write(str(value))


def hierarchies() -> tuple[Path | None, Path | None]:
    """(this process's cgroup in the v2 hierarchy, its cgroup in the v1 memory
    hierarchy), each None where it is not mounted, or not as this process's view of it."""
    own = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            own[controllers or "unified"] = path
            for controller in controllers.split(","):
                own[controller] = path
    unified = memory = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields, _, described = line.partition(" - ")
            root, mount = fields.split()[3:5]
            kind, _, options = described.split()[:3]
            if kind == "cgroup2" and unified is None:
                unified = own_directory(Path(mount), root, own.get("unified"))
            elif kind == "cgroup" and "memory" in options.split(",") and memory is None:
                memory = own_directory(Path(mount), root, own.get("memory"))
    return unified, memory


def own_directory(mount: Path, root: str, path: str | None) -> Path | None:
    """Where this process's group of a hierarchy is under its mount point, if it is there."""
    if path is None or not (path + "/").startswith(root.rstrip("/") + "/"):
        return None
    directory = mount / path[len(root.rstrip("/")) :].lstrip("/")
    return directory if directory.is_dir() else None


def remove_orphans() -> None:
    """Kill and remove the groups of processes that are gone (a caller killed before it could remove its own)."""
    unified, memory_v1 = HIERARCHIES
    for parent in (unified, memory_v1) if os.geteuid() == 0 else ():
        for path in parent.glob(f"{PREFIX}*") if parent is not None else ():
            owner = path.name.removeprefix(PREFIX).split("-")[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                group = Cgroup(path, None) if parent == unified else Cgroup(None, path)
                with contextlib.suppress(OSError):
                    group.kill()
                    group.remove(timeout_s=1.0)


HIERARCHIES = hierarchies()
remove_orphans()
