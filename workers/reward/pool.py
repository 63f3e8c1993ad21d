"""Scoring in a process pool, with a time limit per call.

A reward function that raises or hangs costs one failure reward, never the worker:
on a timeout the whole pool is terminated (the only way to stop a hung call) and
started again, and the calls that were in flight beside it are submitted again.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import traceback
from functools import lru_cache

from workers.reward import functions


@lru_cache(maxsize=8)
def _function(spec: str) -> functions.RewardFn:
    return functions.load(spec)


def _call(spec: str, prompt: str, completion: str, metadata: dict[str, str]) -> tuple[str, object]:
    """Runs in a pool process: ("ok", (reward, details)) or ("error", text)."""
    try:
        return "ok", functions.normalise(_function(spec)(prompt, completion, metadata))
    except Exception as exc:  # the user's code: anything may come out
        return "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"


class ScoringPool:
    def __init__(self, spec: str, processes: int, timeout_s: float):
        functions.load(spec)  # fail here, clearly, rather than in every call
        self.spec, self.processes, self.timeout_s = spec, processes, timeout_s
        self._context = multiprocessing.get_context("forkserver")
        self._pool = self._context.Pool(processes)
        self._generation = 0  # bumped at every restart, so callers know to resubmit

    async def score(self, prompt: str, completion: str, metadata: dict[str, str]) -> tuple[float | None, dict[str, str]]:
        """(reward, details), or (None, details with the failure) on an exception or a timeout."""
        loop = asyncio.get_running_loop()
        while True:  # a call caught in a restart gets a fresh submission and a fresh time limit
            generation, done, deadline = self._generation, loop.create_future(), loop.time() + self.timeout_s

            def resolve(outcome, done=done):
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(outcome))

            self._pool.apply_async(_call, (self.spec, prompt, completion, metadata), callback=resolve,
                                   error_callback=lambda exc: resolve(("error", repr(exc))))
            while not done.done() and generation == self._generation and loop.time() < deadline:
                await asyncio.wait([done], timeout=min(0.05, max(deadline - loop.time(), 0)))
            if done.done():
                status, value = done.result()
                return (value[0], value[1]) if status == "ok" else (None, {"error": str(value)[-2000:]})
            if loop.time() >= deadline:
                self._restart()
                return None, {"error": f"timeout: scoring took longer than {self.timeout_s} s"}
            # the pool was restarted under this call: submit it again

    def _restart(self) -> None:
        self._pool.terminate()
        self._pool.join()
        self._pool = self._context.Pool(self.processes)
        self._generation += 1

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
