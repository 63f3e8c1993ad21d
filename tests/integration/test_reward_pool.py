"""Scoring in real processes: the reward contract, failures recorded, a hang killed and the rest rescored."""

import asyncio
import time

import pytest

from workers.reward import functions
from workers.reward.pool import ScoringPool

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


async def test_a_hang_times_out_and_innocent_calls_are_rescored():
    pool = ScoringPool(SPEC, processes=1, timeout_s=3)  # the others queue behind the hang
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
