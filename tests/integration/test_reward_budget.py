"""A reward function that fails stops the run once its failure budget is spent, counted by kind and logged
once; hung calls time out together; out-of-bound rewards are failures; segments that make no trajectory go
to dead-letter and their offsets are committed."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import msgspec
import pytest

from pipeline.config import load_config, resolve
from pipeline.monitor import budget_spent, reward_summary
from schemas.messages import DeadLetter, PromptGroup, Scored, Segment
from tests import factories
from topics.memory import MemoryTransport
from topics.names import TopicLayout
from workers import runtime
from workers.reward import functions
from workers.reward import worker as reward_worker
from workers.reward.budget import EXIT_CODE
from workers.reward.pool import ScoringPool


def group(n: int) -> PromptGroup:
    return PromptGroup(
        prompt_id=f"e0-r{n}", row_index=n, epoch=0, release_index=n, released_at_version=0, prompt_text="47+8=",
        prompt_tokens=[7, 10, 13], answer="55", n_samples=2,
    )  # fmt: skip


def segment(prompt: PromptGroup, sample: int, token_ids: list[int]) -> Segment:
    return factories.segment(
        trajectory_id=f"{prompt.prompt_id}/{sample}", attempt=f"w:{sample}", token_ids=token_ids, group=prompt
    )


def reward_config(tmp_path, model_dir, *overrides: str):
    names = [f"runs_dir={tmp_path}", "name=budget", f"model.path={model_dir}", "broker.bootstrap=memory"]
    return resolve(load_config(None, [*names, "data.n_samples=2", *overrides]))


async def send_segments(transport: MemoryTransport, segments: list[Segment]) -> None:
    async with transport.outbox() as outbox:
        for message in segments:
            await outbox.send_now("segments", message, key=message.trajectory_id)


async def test_a_reward_failing_on_every_call_stops_the_worker_with_its_failures_counted(tmp_path, demo_model_dir):
    config = reward_config(
        tmp_path, demo_model_dir, "data.reward=bad_rewards:raises", "reward.failure_window=4"
    )  # the default max_failure_rate, 0.5
    transport = MemoryTransport(TopicLayout())
    await send_segments(transport, [segment(group(n), i, [5, 6, 1]) for n in range(3) for i in (0, 1)])
    with pytest.raises(SystemExit) as stopped:  # awaited here: in a task of its own it would end the event loop
        await reward_worker.main(config, asyncio.Event(), transport)
    assert stopped.value.code == EXIT_CODE

    lines = [json.loads(line) for line in (runtime.run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    assert last["source"] == "reward" and last["reward_calls"] >= 4
    assert last["reward_failures"] == {"RuntimeError": last["reward_calls"]}
    assert last["stopped"].startswith(
        "the reward function failed on 4 of the last 4 calls, more than reward.max_failure_rate=0.5 (RuntimeError "
    )
    assert last["stopped"].endswith(
        "; first error: RuntimeError: the verifier is broken): fix data.reward, or raise reward.max_failure_rate "
        "to go on with failure rewards"
    )
    scored = transport.broker.messages("scored", Scored)
    assert len(scored) == last["reward_calls"] and {s.reward for s in scored} == {config.reward.failure_reward}
    logged = "".join(path.read_text() for path in (runtime.run_dir(config) / "logs").glob("*.jsonl"))
    assert logged.count("reward function failed (each new error once)") == 1  # not once per call
    assert logged.count("Traceback") == 1

    reward = SimpleNamespace(role="reward")  # what the launcher makes of that exit
    assert budget_spent(runtime.run_dir(config), [reward], [EXIT_CODE]) == f"asyncrl: {last['stopped']}; stopping"
    assert budget_spent(runtime.run_dir(config), [reward], [1]) is None  # any other exit: restarted as before
    assert reward_summary(lines) == {
        "reward_calls": last["reward_calls"],
        "reward_failures": {"RuntimeError": last["reward_calls"]},
        "unscorable_segments": 0,
    }


async def test_hung_calls_time_out_together_not_one_after_another():
    timeout_s, calls = 4.0, 4
    pool = ScoringPool("bad_rewards:hangs", processes=1, timeout_s=timeout_s, max_processes=8)
    try:
        started = time.monotonic()
        results = await asyncio.gather(*(pool.score("p", str(i), {"answer": "1"}) for i in range(calls)))
        elapsed = time.monotonic() - started
    finally:
        pool.close()
    assert [(reward, details["failure"]) for reward, details in results] == [(None, "timeout")] * calls
    assert timeout_s <= elapsed < 2 * timeout_s, elapsed  # one after another would take calls * timeout_s


async def test_a_reward_out_of_bounds_is_a_failure_with_the_reason():
    assert functions.normalise(1e6) == (1e6, {}) and functions.normalise(-1e6) == (-1e6, {})
    for bad in (1e6 + 1, -1e30, float("nan")):
        with pytest.raises(ValueError, match="must be finite and within ±1e\\+06"):
            functions.normalise(bad)
    pool = ScoringPool("bad_rewards:huge", processes=1, timeout_s=10)
    try:
        assert await pool.score("p", "c", {"answer": "1"}) == (
            None,
            {"error": "reward must be finite and within ±1e+06, got 1e+30", "failure": "invalid"},
        )
    finally:
        pool.close()


async def test_segments_that_make_no_trajectory_go_to_dead_letter_and_are_committed(tmp_path, demo_model_dir):
    config = reward_config(tmp_path, demo_model_dir, "data.reward=builtin")
    transport = MemoryTransport(TopicLayout())
    good, beyond = segment(group(1), 0, [5, 6, 1]), segment(group(1), 1, [5, 10**6, 1])  # vocabulary: 15
    await send_segments(transport, [beyond, good])
    stop = asyncio.Event()
    task = asyncio.create_task(reward_worker.main(config, stop, transport))
    segments_topic = transport.layout.name("segments")
    try:
        for _ in range(1000):
            if transport.broker.committed.get(("reward", segments_topic)) == {0: 2} or task.done():
                break
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert [s.trajectory_id for s in transport.broker.messages("scored", Scored)] == ["e0-r1/0"]
    [letter] = transport.broker.messages("dead-letter", DeadLetter)
    assert letter.reason == (
        "trajectory 'e0-r1/1' cannot be scored: token_ids must lie in [0, 15) (the model's vocabulary), got 1..1000000"
    )
    assert msgspec.msgpack.decode(letter.payload, type=Segment) == beyond and letter.offset == 0
    assert transport.broker.committed[("reward", segments_topic)] == {0: 2}  # its offset advanced
