"""Poison produced into `scored` on the real broker: the trainer dead-letters it, trains the rest, and
`asyncrl replay tail` names each poisoned record in one line."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import msgspec

from pipeline.cli import main
from pipeline.config import load_config, resolve
from schemas.messages import BatchManifest, DeadLetter, PromptGroup, Scored, encode
from schemas.validate import decode
from tests import factories
from topics.broker import EmbeddedBroker
from topics.clients import make_producer, send_and_wait
from topics.inspect import read_records
from topics.names import BATCHES, DEAD_LETTER, PROMPTS, SCORED, TopicLayout
from workers.trainer import worker as trainer_worker

GROUP = PromptGroup(
    prompt_id="p/0", row_index=0, epoch=0, release_index=0, released_at_version=0, prompt_text="1+2=",
    prompt_tokens=[4, 13, 5, 14], answer="3", n_samples=2,
)  # fmt: skip


def scored(sample: int, reward: float) -> Scored:
    return factories.scored(
        group=GROUP,
        sample=sample,
        attempt="rollout-0:1",
        completion_tokens=[6, 1],
        logprobs=[-0.5, -0.25],
        reward=reward,
    )


async def test_trainer_dead_letters_poison_from_the_broker_and_replay_tail_names_it(
    broker: EmbeddedBroker, topic_layout: TopicLayout, demo_model_dir: Path, tmp_path: Path, capsys
) -> None:
    config = resolve(load_config(None, [
        f"runs_dir={tmp_path}", "name=poison", f"model.path={demo_model_dir}", f"broker.bootstrap={broker.bootstrap}",
        f"broker.topic_prefix={topic_layout.prefix}", "trainer.batch_groups=1", "trainer.steps=1",
    ]))  # fmt: skip
    not_utf8 = encode(msgspec.structs.replace(scored(0, 1.0), attempt="utf8")).replace(b"utf8", b"\xff\xfe\xfd\xfc")
    nan = encode(msgspec.structs.replace(scored(0, 1.0), logprobs=[-0.5, math.nan]))
    async with make_producer(broker.bootstrap) as producer:
        await send_and_wait(producer, topic_layout.name(PROMPTS), GROUP, key=GROUP.prompt_id)
        for value in (not_utf8, nan):
            await producer.send_and_wait(topic_layout.name(SCORED), value, key=b"p/0")
        for good in (scored(0, 1.0), scored(1, 0.0)):
            await send_and_wait(producer, topic_layout.name(SCORED), good, key=GROUP.prompt_id)

    await asyncio.wait_for(trainer_worker.main(config, asyncio.Event()), 120)

    letters = [
        decode(r.value, DeadLetter) for r in await read_records(broker.bootstrap, topic_layout.name(DEAD_LETTER))
    ]
    reasons = {letter.payload: letter.reason for letter in letters}
    assert set(reasons) == {not_utf8, nan}
    assert "UnicodeDecodeError" in reasons[not_utf8] and "logprobs[1] is nan" in reasons[nan]
    [manifest] = [
        decode(r.value, BatchManifest) for r in await read_records(broker.bootstrap, topic_layout.name(BATCHES))
    ]
    assert manifest.trajectory_ids == ["p/0/0", "p/0/1"]

    tail = ["replay", "tail", "scored", "--bootstrap", broker.bootstrap, "--prefix", topic_layout.prefix]
    assert await asyncio.to_thread(main, tail) == 0
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith(topic_layout.name(SCORED))]
    assert len(shown) == 4 and shown[0].endswith(
        "undecodable: not a valid Scored message: UnicodeDecodeError: "
        "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"
    )
    assert "undecodable: not a valid Scored message: logprobs[1] is nan" in shown[1]
