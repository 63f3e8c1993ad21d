"""The prompt source on a real broker: bad rows to dead-letter, the staleness window, restart without re-release."""

import asyncio
import json

from pipeline.config import load_config, resolve
from pipeline.demo_model import build_model, build_tokenizer
from schemas.messages import DeadLetter, PromptGroup, WeightVersion
from topics.clients import make_producer, send_and_wait
from topics.readers import read_topic
from workers import prompt_source
from workers.weights import unique_state_dict, write_version

ROWS = [
    json.dumps({"prompt": "1+2=", "answer": "3"}),
    "{not json",
    json.dumps({"prompt": "4+4=", "answer": 8, "source": "x"}),
    json.dumps({"prompt": "5+1="}),
    "",
    json.dumps({"prompt": "9+9=", "answer": "18"}),
    json.dumps(["a", "list"]),
    json.dumps({"prompt": "2+2=", "answer": "4"}),
    json.dumps({"prompt": "3+3=", "answer": "6"}),
]


async def released(bootstrap, layout, expected: int, timeout_s: float = 30) -> list[PromptGroup]:
    for _ in range(int(timeout_s * 10)):
        groups = [r.message for r in await read_topic(bootstrap, layout.name("prompts"), PromptGroup)]
        if len(groups) >= expected:
            return groups
        await asyncio.sleep(0.1)
    raise AssertionError(f"only {len(groups)} of {expected} groups released")


async def run_source_until(config, condition):
    stop = asyncio.Event()
    task = asyncio.create_task(prompt_source.main(config, stop))
    try:
        return await condition()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_rows_window_and_restart(broker, topic_layout, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(ROWS) + "\n")
    tokenizer = build_tokenizer(tmp_path / "model")
    model = build_model(tmp_path / "model", tokenizer)  # the source reads its positions; v1 is a real file
    config = resolve(
        load_config(
            None,
            [
                f"runs_dir={tmp_path}",
                "name=src",
                f"data.source={data}",
                "data.reward=math",
                f"model.path={tmp_path / 'model'}",
                f"broker.bootstrap={broker.bootstrap}",
                f"broker.topic_prefix={topic_layout.prefix}",
                "trainer.batch_groups=2",
                "trainer.max_staleness=0",
                "trainer.steps=3",
                "data.n_samples=3",
            ],
        )
    )

    # version 0, eta 0: exactly one batch (2 groups) may be out
    first = await run_source_until(config, lambda: released(broker.bootstrap, topic_layout, 2))
    await asyncio.sleep(0.3)
    assert len(await released(broker.bootstrap, topic_layout, 2)) == 2
    letters = [r.message for r in await read_topic(broker.bootstrap, topic_layout.name("dead-letter"), DeadLetter)]
    assert sorted(l.offset for l in letters) == [2, 4, 7]  # line numbers of the bad rows
    assert any("not JSON" in l.reason for l in letters) and any("'answer'" in l.reason for l in letters)
    assert {l.payload for l in letters} == {ROWS[1].encode(), ROWS[3].encode(), ROWS[6].encode()}

    # the trainer moves to version 1 and drops one group: two more batches' worth of room (2 + 1)
    path, digest = write_version(unique_state_dict(model), tmp_path / "weights", 1, keep=2)
    async with make_producer(broker.bootstrap) as producer:
        await send_and_wait(
            producer,
            topic_layout.name("weights"),
            WeightVersion(version=1, uri=str(path), content_hash=digest, step=1, groups_consumed=2, groups_dropped=1),
        )
    # a restarted source continues after what `prompts` holds instead of re-releasing
    groups = await run_source_until(config, lambda: released(broker.bootstrap, topic_layout, 5))
    await asyncio.sleep(0.3)
    groups = await released(broker.bootstrap, topic_layout, 5)
    assert len(groups) == 5  # N < (1 + 0 + 1) * 2 + 1
    assert [g.release_index for g in groups] == [0, 1, 2, 3, 4]
    assert len({g.prompt_id for g in groups}) == 5 and len({g.row_index for g in groups}) == 5  # one epoch of 5 rows
    assert [g.released_at_version for g in groups] == [0, 0, 1, 1, 1]
    assert {g.prompt_text for g in groups} == {"1+2=", "4+4=", "9+9=", "2+2=", "3+3="}
    by_text = {g.prompt_text: g for g in groups}
    assert by_text["4+4="].answer == "8" and by_text["4+4="].metadata == {"source": "x"}
    assert tokenizer.decode(by_text["1+2="].prompt_tokens) == "1+2=" and len(by_text["1+2="].prompt_tokens) == 4
    assert first[:2] == groups[:2] and all(g.n_samples == 3 for g in groups)
