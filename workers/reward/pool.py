"""Scoring in worker processes, with a time limit per call.

A reward function that raises, hangs or returns what is not a reward costs one failure
reward, never the worker: each call runs in a process of its own at a time; on a timeout
that process alone is killed (SIGKILL: the only way to stop a hung call), so the calls
beside it are untouched. A process loads the function before it is given a call, so a
call's time limit measures the function alone, never a fresh process's start-up.

Hung calls time out together, not one after another: `processes` processes serve the
calls, and while one of them has run its call for more than a quarter of the time limit
(it may be hung), every call waiting behind it gets a spare process, up to `max_processes`
in all; a spare ends once no call waits for it. So N calls that all hang cost about one
time limit (while N <= max_processes), and calls that are merely slow never start spares.

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
from multiprocessing.connection import Connection

from workers.reward import functions

HANG_SHARE = 0.25  # a call running this share of its time limit may be hung: the calls behind it get spares
START_LIMIT_S = 60.0  # a scoring process that has not loaded the function by then is given up
GROUP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
Result = tuple[float | None, dict[str, str]]


def _call(fn: functions.RewardFn, prompt: str, completion: str, metadata: dict[str, str]) -> tuple[str, object]:
    """Runs in a scoring process: ("ok", (reward, details)), or ("failed", details) with the error and the
    failure's kind: the exception's type when the function raised, 'invalid' when it returned no reward."""
    try:
        result = fn(prompt, completion, metadata)
    except Exception as exc:  # the user's code: anything may come out
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        return "failed", {"error": text[-2000:], "failure": type(exc).__name__}
    try:
        return "ok", functions.normalise(result)
    except Exception as exc:  # a value, or details whose str() raises
        return "failed", {"error": str(exc)[-2000:], "failure": "invalid"}


def _serve(conn: Connection, spec: str, task: str) -> None:
    """A scoring process: load the function, say so, then one call at a time until the parent closes the pipe."""
    for signum in GROUP_SIGNALS:  # they were blocked since the start (see _Scorer): none got through
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        fn = functions.load(spec, task)
    except Exception as exc:  # the parent loaded it, so this is rare: say why rather than die silently
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        conn.send(_call(fn, *call))


class _Scorer:
    """One scoring process and the parent's end of its pipe."""

    def __init__(self, context: multiprocessing.context.BaseContext, spec: str, task: str):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, spec, task), daemon=True)
        self.ready = False  # the function is loaded: calls may come
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)  # inherited: no death while it starts
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()

    async def start(self) -> None:
        """Wait until the process has loaded the function (at once when it has); OSError if it could not."""
        if not self.ready:
            status, error = await self._receive()
            if status != "ready":
                raise OSError(f"cannot load the reward function: {error}")
            self.ready = True

    async def call(self, args: tuple) -> tuple[str, object]:
        """Send one call and wait for its answer."""
        self.conn.send(args)
        return await self._receive()

    async def _receive(self) -> tuple[str, object]:
        """The process's next message, without blocking the event loop (EOFError if it died)."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(self.conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(self.conn.fileno())
        return self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class InlineScoring:
    """Scoring in the reward worker's own process (reward.processes = 0 with the task's own verifier): no
    process, pipe or time limit per call, for a fast verifier trusted not to hang or kill the worker (the shipped
    tasks'). A function that raises or returns no reward still costs one failure reward, as in the pool."""

    def __init__(self, spec: str, task: str):
        self.fn = functions.load(spec, task)

    async def score(self, prompt: str, completion: str, metadata: dict[str, str]) -> Result:
        status, value = _call(self.fn, prompt, completion, metadata)
        return value if status == "ok" else (None, value)

    def close(self) -> None:
        pass


def scoring(spec: str, processes: int, timeout_s: float, task: str, max_processes: int) -> ScoringPool | InlineScoring:
    """Where the reward function runs: a pool of `processes` scoring processes; with 0, the task's own verifier
    ('builtin') in the caller's process, and any other function in a pool of one."""
    if processes == 0 and spec == "builtin":
        return InlineScoring(spec, task)
    return ScoringPool(spec, max(processes, 1), timeout_s, task, max_processes)


class ScoringPool:
    def __init__(
        self, spec: str, processes: int, timeout_s: float, task: str = "arith", max_processes: int | None = None
    ):
        functions.load(spec, task)  # fail here, clearly, rather than in every call
        self.spec, self.task, self.timeout_s, self.processes = spec, task, timeout_s, processes
        self.max_processes = max(max_processes or processes, processes)
        self._context = multiprocessing.get_context("spawn")  # no inherited locks or threads
        self._scorers = [self._new() for _ in range(processes)]  # every live process
        self._idle = list(self._scorers)
        self._busy: dict[_Scorer, float] = {}  # process -> when its call started (loop time)
        self._waiting = 0  # calls waiting for a process
        self._changed = asyncio.Event()  # a process freed, lost, or possibly hung: waiting calls look again

    async def score(self, prompt: str, completion: str, metadata: dict[str, str]) -> Result:
        """(reward, details), or (None, details with 'error' and the failure's kind, 'failure': the exception's
        type, 'invalid', 'timeout' or 'died').

        The time limit runs from when a ready scoring process takes the call, not while it queues or starts.
        """
        scorer = await self._acquire()
        try:
            await asyncio.wait_for(scorer.start(), START_LIMIT_S)
            loop = asyncio.get_running_loop()
            self._busy[scorer] = loop.time()
            loop.call_later(self.timeout_s * HANG_SHARE + 0.01, self._changed.set)  # by then it looks hung
            status, value = await asyncio.wait_for(scorer.call((prompt, completion, metadata)), self.timeout_s)
        except BaseException as exc:  # its answer may still come: this process is never asked again
            self._discard(scorer)
            if isinstance(exc, TimeoutError) and scorer.ready:
                return None, {"error": f"timeout: scoring took longer than {self.timeout_s} s", "failure": "timeout"}
            if isinstance(exc, (TimeoutError, EOFError, OSError)):
                return None, {"error": f"the scoring process died: {exc!r}", "failure": "died"}
            raise  # cancelled: the worker is stopping
        self._release(scorer)
        return value if status == "ok" else (None, value)

    async def _acquire(self) -> _Scorer:
        """An idle process; else a new one while the pool is short of `processes` or a busy call looks hung
        (up to `max_processes`); else wait for a change."""
        while True:
            if self._idle:
                return self._idle.pop()
            now = asyncio.get_running_loop().time()
            hung = any(now - started >= self.timeout_s * HANG_SHARE for started in self._busy.values())
            if len(self._scorers) < self.max_processes and (len(self._scorers) < self.processes or hung):
                scorer = self._new()
                self._scorers.append(scorer)
                return scorer
            self._changed.clear()
            self._waiting += 1
            try:
                await self._changed.wait()
            finally:
                self._waiting -= 1

    def _new(self) -> _Scorer:
        return _Scorer(self._context, self.spec, self.task)

    def _release(self, scorer: _Scorer) -> None:
        """A process done with its call: idle again, or ended when it is a spare nobody waits for."""
        self._busy.pop(scorer, None)
        if len(self._scorers) > self.processes and not self._waiting:
            self._discard(scorer)
            return
        self._idle.append(scorer)
        self._changed.set()

    def _discard(self, scorer: _Scorer) -> None:
        self._busy.pop(scorer, None)
        self._scorers.remove(scorer)
        scorer.kill()
        self._changed.set()

    def close(self) -> None:
        for scorer in self._scorers:
            scorer.kill()
