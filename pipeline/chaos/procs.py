"""Processes seen from /proc (`pipeline.procfs`): which one a kill targets, and which ones a run must not leave behind."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from pipeline.procfs import Proc, processes


def descendants(pid: int, table: dict[int, Proc] | None = None) -> dict[int, Proc]:
    """Children of `pid`, theirs, and so on."""
    table = processes() if table is None else table
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for proc in table.values():
            if proc.ppid == parent and proc.pid not in found:
                found[proc.pid] = proc
                frontier.append(proc.pid)
    return found


def mentioning(*texts: str) -> list[Proc]:
    """Live processes whose command line holds one of `texts` (a run directory, a broker address), this one and
    its ancestors left out: the harness's own command line may name its output directory."""
    table = processes()
    mine, pid = set(), os.getpid()
    while pid in table and pid not in mine:
        mine.add(pid)
        pid = table[pid].ppid
    return [p for p in table.values() if p.pid not in mine and any(text in p.cmdline for text in texts)]


def alive(seen: dict[int, Proc]) -> list[Proc]:
    """Those of `seen` still running as the same program (a reused pid has another command line)."""
    table = processes()
    return [proc for pid, proc in seen.items() if pid in table and table[pid].cmdline == proc.cmdline]


def kill(pid: int) -> bool:
    """SIGKILL; False when the process was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def leftovers(seen: dict[int, Proc], texts: tuple[str, ...], grace_s: float) -> list[Proc]:
    """What is still alive `grace_s` from now of `seen` or of anything naming `texts`: a worker orphaned by a
    SIGKILLed launcher may take 5 s (ORPHAN_GRACE_S) to notice, so give it its time before counting it."""
    deadline = time.monotonic() + grace_s
    while True:
        left = {p.pid: p for p in [*alive(seen), *mentioning(*texts)]}
        if not left or time.monotonic() >= deadline:
            return list(left.values())
        time.sleep(0.25)


def kill_all(found: list[Proc]) -> None:
    """After counting them: nothing a trial started may outlive the harness."""
    for proc in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
