"""Scoring in real processes: the reward contract, failures recorded, a hang killed, the rest untouched,
signals to the whole process group ignored by the scorers."""

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from workers.reward import functions
from workers.reward.pool import InlineScoring, ScoringPool, scoring

SPEC = "reward_plugins:judge"


def test_reward_function_contract():
    assert functions.normalise(0.5) == (0.5, {})
    assert functions.normalise((1, {"why": 3})) == (1.0, {"why": "3"})
    for bad in ("1.0", None, True, float("inf"), (1.0, 2.0)):
        with pytest.raises(ValueError):
            functions.normalise(bad)
    assert functions.load("builtin")("47+8=", "55", {"answer": "55"}) == 1.0
    assert functions.load("math")("", "The answer is $\\frac{1}{2}$", {"answer": "0.5"})[0] == 1.0
    with pytest.raises(ValueError, match="cannot be loaded"):
        functions.load("no_such_module:fn")


async def test_failures_become_details_not_crashes():
    pool = ScoringPool(SPEC, processes=2, timeout_s=20)
    try:
        assert await pool.score("p", "42", {"answer": "42"}) == (1.0, {"prompt_seen": "p"})
        reward, details = await pool.score("p", "raise", {"answer": "42"})
        assert reward is None and "the user's verifier broke" in details["error"]
        reward, details = await pool.score("p", "nan", {"answer": "42"})
        assert reward is None and "finite" in details["error"]
    finally:
        pool.close()


def test_only_the_tasks_own_verifier_scores_inline():
    inline, pool = scoring("builtin", 0, 10, "arith", 1), scoring(SPEC, 0, 10, "arith", 1)  # a user's function
    try:
        assert isinstance(inline, InlineScoring) and isinstance(pool, ScoringPool) and pool.processes == 1
    finally:
        inline.close(), pool.close()


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "pool"])
async def test_inline_scoring_keeps_the_pools_contract(inline):
    """The same rewards and failure details whether scored in the worker's own process or in a scoring process."""
    scorer = InlineScoring(SPEC, "arith") if inline else ScoringPool(SPEC, 1, 20)
    processes = 0 if inline else 1
    try:
        assert await scorer.score("p", "42", {"answer": "42"}) == (1.0, {"prompt_seen": "p"})
        assert bool(multiprocessing.active_children()) == (processes > 0)  # inline: no scoring process at all
        reward, details = await scorer.score("p", "raise", {"answer": "42"})
        assert reward is None and "the user's verifier broke" in details["error"] and details["failure"]
        reward, details = await scorer.score("p", "nan", {"answer": "42"})
        assert reward is None and details["failure"] == "invalid"
    finally:
        scorer.close()


async def test_a_hang_times_out_and_innocent_calls_are_scored():
    pool = ScoringPool(SPEC, processes=1, timeout_s=3)  # the others queue behind the hang; their limit starts later
    try:
        started = time.monotonic()
        hang = asyncio.create_task(pool.score("p", "hang", {"answer": "1"}))
        await asyncio.sleep(0.5)
        others = [pool.score("p", str(i), {"answer": "1"}) for i in range(4)]
        results = await asyncio.gather(hang, *others)
        assert results[0][0] is None and "timeout" in results[0][1]["error"]
        assert [r for r, _ in results[1:]] == [0.0, 1.0, 0.0, 0.0]
        assert time.monotonic() - started < 15
        assert await pool.score("p", "1", {"answer": "1"}) == (1.0, {"prompt_seen": "p"})  # the pool lives on
    finally:
        pool.close()


async def test_scorers_outlive_a_group_signal_and_close_leaves_none():
    """`scancel` and Ctrl-C signal every process of the group: the scorers keep going (the worker
    decides when to stop), also while they are still starting, and `close` kills them all, reaped."""
    pool = ScoringPool(SPEC, processes=2, timeout_s=20)
    pids = [scorer.process.pid for scorer in pool._scorers]

    def signal_the_scorers() -> None:
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)

    try:
        signal_the_scorers()  # still starting: the signals are blocked from before the spawn
        # one call on each scorer (two at once), then the signals again while both are idle
        assert (
            await asyncio.gather(*(pool.score("p", "1", {"answer": "1"}) for _ in pids))
            == [(1.0, {"prompt_seen": "p"})] * 2
        )
        signal_the_scorers()
        await asyncio.sleep(0.3)
        assert [scorer.process.pid for scorer in pool._scorers if scorer.process.is_alive()] == pids
        assert [r for r, _ in await asyncio.gather(*(pool.score("p", str(i), {"answer": "1"}) for i in range(4)))] == [
            0.0,
            1.0,
            0.0,
            0.0,
        ]
    finally:
        pool.close()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), "a scoring process was left (or left unreaped)"
