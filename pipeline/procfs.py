"""Live processes read from /proc: the launcher finds a run's remaining workers by their command lines, the chaos
harness the processes it kills and those a run must not leave behind (`pipeline.chaos.procs`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    cmdline: str


def processes() -> dict[int, Proc]:
    """Every live process (zombies left out: they hold nothing but a pid), by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if state != "Z":
            found[int(entry.name)] = Proc(int(entry.name), int(ppid), cmdline)
    return found
