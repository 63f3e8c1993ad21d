"""Scoring in worker processes, with a time limit per call.

A reward function that raises or hangs costs one failure reward, never the worker:
each call runs in a process of its own at a time; on a timeout that process alone
is killed (SIGKILL: the only way to stop a hung call) and replaced, so the calls
beside it are untouched.

The scoring processes ignore SIGINT and SIGTERM: Ctrl-C in a terminal and Slurm's
`scancel` signal the whole process group, and a process killed while it talks to
its parent could leave the parent waiting. The parent alone ends them (SIGKILL on
close), and they die with it if it dies first (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import signal
import traceback
from functools import lru_cache
from multiprocessing.connection import Connection

from workers.reward import functions


@lru_cache(maxsize=8)
def _function(spec: str, task: str) -> functions.RewardFn:
    return functions.load(spec, task)


def _call(spec: str, task: str, prompt: str, completion: str, metadata: dict[str, str]) -> tuple[str, object]:
    """Runs in a scoring process: ("ok", (reward, details)) or ("error", text)."""
    try:
        return "ok", functions.normalise(_function(spec, task)(prompt, completion, metadata))
    except Exception as exc:  # the user's code: anything may come out
        return "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"


GROUP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _serve(conn: Connection) -> None:
    """A scoring process: one call at a time until the parent closes the pipe."""
    for signum in GROUP_SIGNALS:  # they were blocked since the start (see _Scorer): none got through
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        conn.send(_call(*call))


class _Scorer:
    """One scoring process and the parent's end of its pipe."""

    def __init__(self, context: multiprocessing.context.BaseContext):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), daemon=True)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)  # inherited: no death while it starts
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()

    async def call(self, args: tuple) -> tuple[str, object]:
        """Send one call and wait for its answer without blocking the event loop."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        self.conn.send(args)
        loop.add_reader(self.conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(self.conn.fileno())
        return self.conn.recv()  # EOFError if the process died

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class ScoringPool:
    def __init__(self, spec: str, processes: int, timeout_s: float, task: str = "arith"):
        functions.load(spec, task)  # fail here, clearly, rather than in every call
        self.spec, self.task, self.timeout_s = spec, task, timeout_s
        self._context = multiprocessing.get_context("spawn")  # no inherited locks or threads
        self._scorers = [_Scorer(self._context) for _ in range(processes)]
        self._idle: asyncio.Queue[_Scorer] | None = None  # made in the event loop, at the first call

    async def score(
        self, prompt: str, completion: str, metadata: dict[str, str]
    ) -> tuple[float | None, dict[str, str]]:
        """(reward, details), or (None, details with the failure) on an exception or a timeout.

        The time limit runs from when a scoring process takes the call, not while it queues.
        """
        if self._idle is None:
            self._idle = asyncio.Queue()
            for scorer in self._scorers:
                self._idle.put_nowait(scorer)
        scorer = await self._idle.get()
        try:
            status, value = await asyncio.wait_for(
                scorer.call((self.spec, self.task, prompt, completion, metadata)), self.timeout_s
            )
        except BaseException as exc:  # its answer may still come: this process is never asked again
            scorer = self._replace(scorer)
            if isinstance(exc, TimeoutError):
                return None, {"error": f"timeout: scoring took longer than {self.timeout_s} s"}
            if isinstance(exc, (EOFError, OSError)):
                return None, {"error": f"the scoring process died: {exc!r}"}
            raise  # cancelled: the worker is stopping
        finally:
            self._idle.put_nowait(scorer)
        return (value[0], value[1]) if status == "ok" else (None, {"error": str(value)[-2000:]})

    def _replace(self, scorer: _Scorer) -> _Scorer:
        scorer.kill()
        fresh = _Scorer(self._context)
        self._scorers[self._scorers.index(scorer)] = fresh
        return fresh

    def close(self) -> None:
        for scorer in self._scorers:
            scorer.kill()
