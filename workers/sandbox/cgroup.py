"""A cgroup per sandbox: the bound on all the memory an execution holds (files in memfds, tmpfs and shared memory
included, which the address-space limit does not count), and a list of its processes that no program can leave.

bwrap starts behind a gate (`Cgroup.gate`): a shell that joins the group, then execs bwrap, so every process of
the sandbox is born in it, whatever it forks and however it detaches from bwrap. The shell moves itself: a
single-threaded process that does (writing 0 to v1's `tasks`) needs none of the global lock that moving
another one takes, which costs a grace period (about 10 ms) per execution. One hierarchy: v1's memory one where it is mounted (`memory.limit_in_bytes`, and
`memory.memsw.limit_in_bytes` so that no swap goes past it), else v2 where its memory controller is available
(`memory.max`; there `cgroup.kill` kills the group at once). `kill` SIGKILLs whatever is left in it (the sandbox
kills its pid 1 first, which ends the pid namespace); `remove` returns once the group is empty and gone.

Creating cgroups needs root (or a delegated subtree), a writable cgroup file system, and bash in v2 (the gate
names file descriptors above 9 there): `Cgroup.create` returns None where it cannot, and the sandbox then ends an execution
through its pid namespace alone, with no memory bound beyond the rlimits.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from pathlib import Path

PREFIX = "asyncrl-sandbox-"  # then the creating process's pid and a count
NAMES = itertools.count()
POLL_S = 0.002  # between two looks at a group that is being emptied
BASH = "/bin/bash"


class Cgroup:
    """One group, in the v1 memory hierarchy (`v1`) or in v2."""

    def __init__(self, path: Path, v1: bool):
        self.path, self.v1 = path, v1

    @classmethod
    def create(cls) -> Cgroup | None:
        """A new, empty group beside this process's own, or None where none can be made and used here."""
        if os.geteuid() != 0:
            return None
        name = f"{PREFIX}{os.getpid()}-{next(NAMES)}"
        unified, memory_v1 = HIERARCHIES
        if memory_v1 is not None and (path := make(memory_v1 / name)) is not None:
            return cls(path, v1=True)
        if unified is not None and os.access(BASH, os.X_OK) and (path := make(unified / name)) is not None:
            if (path / "memory.max").exists() and (path / "cgroup.kill").exists():
                return cls(path, v1=False)
            remove_directory(path)
        return None

    def gate(self, user: int, oom_score: int) -> tuple[list[str], int | None]:
        """(a command to put before another, a descriptor to pass it or None): a shell that joins the group, puts
        its OOM score at `oom_score` (its children inherit it) and execs the command after it, as `user`; exit 1
        with a line saying so when it cannot join. In v1 it writes 0 to the group's `tasks`, handed to `user`
        (moving itself takes no global lock); in v2 to a descriptor of `cgroup.procs` opened here (the kernel
        checks the opener's rights, and the common ancestor's file is root's), with bash, which names
        descriptors above 9."""
        if self.v1:
            os.chown(self.path / "tasks", user, -1)
            join, fd, shell = f"echo 0 > {self.path / 'tasks'}", None, "/bin/sh"
        else:
            fd = os.open(self.path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
            join, shell = f"echo 0 >&{fd} && exec {fd}>&-", BASH
        script = f'{join} && echo {oom_score} > /proc/self/oom_score_adj && exec "$@"'
        return [shell, "-c", f'{script}; echo "sandbox: cannot join its cgroup" >&2; exit 1', "gate"], fd

    def limit_memory(self, limit: int) -> None:
        """Bound the memory of the group's processes to `limit` bytes, swap included (none past it); the kernel's
        OOM killer ends a process of the group that would go over."""
        if not self.v1:
            write(self.path / "memory.max", limit)
            with contextlib.suppress(FileNotFoundError):  # no swap accounting here
                write(self.path / "memory.swap.max", 0)
            return
        swap = self.path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            write(swap, -1)  # memory + swap may never be below memory alone: lift it, then bound both
        write(self.path / "memory.limit_in_bytes", limit)
        if swap.exists():
            write(swap, limit)

    def memory_used(self) -> int:
        """Bytes charged to the group now."""
        return int((self.path / ("memory.usage_in_bytes" if self.v1 else "memory.current")).read_text())

    def oom_kills(self) -> int:
        """How many processes of the group the kernel killed for going over its memory bound."""
        counts = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
        return int(dict(line.split() for line in counts.splitlines()).get("oom_kill", "0"))

    def processes(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    def kill(self) -> None:
        """SIGKILL every process of the group: at once in v2; in v1 each one listed, through a pidfd opened while
        it is still a member (so never another process that took a freed pid)."""
        if not self.v1:
            write(self.path / "cgroup.kill", 1)
            return
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(pid)
                try:
                    if pid in self.processes():
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                finally:
                    os.close(pidfd)

    def remove(self, timeout_s: float) -> bool:
        """Wait until no process is left in the group (killing what is), then remove it; False when one still is
        at `timeout_s` (the group is then kept, to be seen)."""
        deadline = time.monotonic() + timeout_s
        while self.processes():
            if time.monotonic() > deadline:
                return False
            self.kill()
            time.sleep(POLL_S)
        while True:
            try:
                self.path.rmdir()
                return True
            except OSError:  # EBUSY while the kernel finishes with the last member
                if time.monotonic() > deadline:
                    return False
                time.sleep(POLL_S)


def make(path: Path) -> Path | None:
    try:
        path.mkdir()
    except OSError:  # read-only, not permitted, or the controller refuses another group
        return None
    return path


def remove_directory(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def write(path: Path, value: int) -> None:
    with open(path, "w") as file:
        file.write(str(value))


def hierarchies() -> tuple[Path | None, Path | None]:
    """(this process's cgroup in the v2 hierarchy, its cgroup in the v1 memory hierarchy), each None where it is
    not mounted, or not as this process's view of it."""
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
    for parent, v1 in ((unified, False), (memory_v1, True)) if os.geteuid() == 0 else ():
        for path in parent.glob(f"{PREFIX}*") if parent is not None else ():
            owner = path.name.removeprefix(PREFIX).split("-")[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):
                    Cgroup(path, v1).remove(timeout_s=1.0)


HIERARCHIES = hierarchies()
remove_orphans()
