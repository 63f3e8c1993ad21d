"""Where the CPU goes during a benchmark: cores used by each role of the pipeline, from /proc.

A thread samples the process tree under the benchmark every `interval_s`: each child is
a role (`asyncrl worker <role>`, or the broker; the fork server the workers come from, whose
imports are theirs, is `other`), and its own children (reward scorers, torchrun ranks) count
towards it; the benchmark process itself is `monitor`. Linux only.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


Table = dict[int, tuple[int, int, int, str]]


def process_table() -> Table:
    """pid -> (parent pid, CPU ticks used so far, ticks of the children it has reaped, command line), for every
    readable process. A sandboxed execution lives ~26 ms, far less than a sampling interval: it is only ever
    seen in its scorer's count of reaped children."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        own, reaped = int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])  # u/s time, children's
        table[int(entry.name)] = (int(fields[1]), own, reaped, cmdline)
    return table


def role_of(cmdline: str) -> str:
    words = cmdline.split()
    if "worker" in words and words.index("worker") + 1 < len(words):
        return words[words.index("worker") + 1]
    return "broker" if "tansu" in cmdline else "other"


def ticks_by_role(root: int, table: Table, known: dict[int, str] | None = None) -> dict[int, tuple[str, int]]:
    """pid -> (role, ticks) for `root` (its own: the workers it reaps count as themselves) and every process
    below it (with the children each has reaped). A process that ended but is not reaped yet has an empty command
    line and its ticks still: it keeps its role from `known` (pid -> role seen before), or a run's last sample
    would count a worker's whole CPU time as "other"."""
    known = known or {}
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {root: ("monitor", table[root][1])}, [(child, None) for child in children.get(root, [])]
    while todo:
        pid, role = todo.pop()
        _, own, reaped, cmdline = table[pid]
        role = role or (role_of(cmdline) if cmdline else known.get(pid, "other"))
        found[pid] = (role, own + reaped)
        todo += [(child, role) for child in children.get(pid, [])]
    return found


class CpuSampler:
    """Samples cumulative CPU seconds per role until stopped; `cores(start, end)` reads a window."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.root = interval_s, os.getpid()
        self.times: list[float] = []
        self.totals: list[dict[str, float]] = []  # cumulative CPU seconds per role, one dict per sample
        self.last: dict[int, tuple[str, int]] = {}  # every pid seen: ended processes keep their last count
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join()

    def _loop(self) -> None:
        parents: dict[int, int] = {}
        while not self.stopping.wait(self.interval_s):
            table = process_table()
            for pid in [
                pid for pid in self.last if pid not in table and parents.get(pid) in table.keys() - {self.root}
            ]:
                del self.last[pid]  # reaped by a live parent, whose count now holds it (the root's leaves it out)
            parents.update((pid, table[pid][0]) for pid in table)
            self.last.update(ticks_by_role(self.root, table, {pid: role for pid, (role, _) in self.last.items()}))
            totals: dict[str, float] = {}
            for role, ticks in self.last.values():
                totals[role] = totals.get(role, 0.0) + ticks / TICKS_PER_S
            self.times.append(time.time())
            self.totals.append(totals)

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Average cores used by each role between two wall-clock times (the nearest samples inside)."""
        first = bisect.bisect_left(self.times, start)
        last = bisect.bisect_right(self.times, end) - 1
        if last <= first:
            return {}
        seconds = self.times[last] - self.times[first]
        before, after = self.totals[first], self.totals[last]
        used = {role: (after[role] - before.get(role, 0.0)) / seconds for role in after}
        return {role: round(cores, 3) for role, cores in sorted(used.items(), key=lambda kv: -kv[1])}
