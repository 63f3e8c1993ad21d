"""The reward worker on a real broker: segments joined in order, first finished attempt wins, failures recorded."""

import asyncio

from pipeline.config import load_config, resolve
from pipeline.demo_model import build_model, build_tokenizer
from schemas.messages import PromptGroup, Scored
from tests.factories import text_segment
from topics.clients import make_producer, send
from topics.readers import read_topic
from workers.reward import worker as reward_worker


async def score_two(config, broker, topic_layout) -> dict[str, Scored]:
    """Run the reward worker until two trajectories are scored, and a while longer so a duplicate would show."""
    stop = asyncio.Event()
    task = asyncio.create_task(reward_worker.main(config, stop))
    try:
        for _ in range(300):
            scored = [r.message for r in await read_topic(broker.bootstrap, topic_layout.name("scored"), Scored)]
            if len(scored) >= 2:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # a duplicate would have arrived by now
        return {
            s.trajectory_id: s
            for s in (r.message for r in await read_topic(broker.bootstrap, topic_layout.name("scored"), Scored))
        }
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_segments_become_one_scored_trajectory_each(broker, topic_layout, tmp_path):
    tokenizer = build_tokenizer(tmp_path / "model")
    build_model(tmp_path / "model", tokenizer)  # the worker reads the model's vocabulary from its config
    config = resolve(
        load_config(
            None,
            [
                f"runs_dir={tmp_path}",
                "name=rw",
                f"model.path={tmp_path / 'model'}",
                "data.n_samples=2",
                f"broker.bootstrap={broker.bootstrap}",
                f"broker.topic_prefix={topic_layout.prefix}",
            ],
        )
    )
    group = PromptGroup(
        prompt_id="e0-r1",
        row_index=1,
        epoch=0,
        release_index=0,
        released_at_version=3,
        prompt_text="47+8=",
        prompt_tokens=tokenizer("47+8=")["input_ids"],
        answer="55",
        n_samples=2,
    )
    messages = [
        # sample 0: attempt a (dies after one segment), then attempt b finishes across two versions
        text_segment(tokenizer, "5", trajectory_id="e0-r1/0", attempt="a:0", version=3, finish_reason="interrupted", group=group),
        text_segment(tokenizer, "5", trajectory_id="e0-r1/0", attempt="b:0", segment_index=1, version=5),  # arrives before its segment 0
        text_segment(tokenizer, "5", trajectory_id="e0-r1/0", attempt="b:0", version=4, finish_reason="interrupted", group=group),
        text_segment(tokenizer, "6", trajectory_id="e0-r1/0", attempt="a:0", segment_index=1, version=4),  # attempt a finishes late: ignored
        # sample 1: wrong answer, one segment
        text_segment(tokenizer, "54", trajectory_id="e0-r1/1", attempt="b:1", version=4, group=group),
        text_segment(tokenizer, "54", trajectory_id="e0-r1/1", attempt="b:1", version=4, group=group),  # delivered twice
    ]  # fmt: skip
    async with make_producer(broker.bootstrap) as producer:
        for message in messages:
            await send(producer, topic_layout.name("segments"), message, key=message.trajectory_id)
        await producer.send_and_wait(topic_layout.name("segments"), b"\x00garbage", key=b"x")

    scored = await score_two(config, broker, topic_layout)

    assert sorted(scored) == ["e0-r1/0", "e0-r1/1"]
    first = scored["e0-r1/0"]
    assert first.attempt == "b:0" and first.num_segments == 2
    assert first.completion_text == "55" and first.reward == 1.0
    assert first.versions == [4, 5, 5] and len(first.logprobs) == 3  # "5" @v4, then "5" + eos @v5
    assert first.released_at_version == 3 and first.prompt_tokens == group.prompt_tokens
    assert scored["e0-r1/1"].reward == 0.0 and scored["e0-r1/1"].completion_text == "54"
