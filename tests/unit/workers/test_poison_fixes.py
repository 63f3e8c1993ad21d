"""What the poison harness (`asyncrl chaos --poison`) found, pinned where it is cheap: dataset rows that stopped a
run, a poison attempt that shut out the real one, a forged trajectory that stalled its group."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline.config import load_config, resolve
from pipeline.demo_model import build_model, build_tokenizer
from schemas.messages import BatchManifest, DeadLetter, PromptGroup, Scored, Segment
from tests import factories
from tests.unit.workers.test_worker_loops import INLINE_SCORING
from topics.assembly import SegmentAssembler
from topics.memory import MemoryTransport
from topics.names import TopicLayout
from workers.reward import worker as reward_worker
from workers.rows import read_rows
from workers.trainer import worker as trainer_worker

GROUP = PromptGroup(
    prompt_id="e0-r1", row_index=1, epoch=0, release_index=0, released_at_version=0, prompt_text="47+8=",
    prompt_tokens=[7, 10, 13], answer="55", n_samples=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    build_model(path, build_tokenizer(path), seed=0)
    return path


def config_for(tmp_path: Path, model_dir: Path, *overrides: str):
    base = [f"runs_dir={tmp_path}", "name=fix", f"model.path={model_dir}", "broker.bootstrap=memory"]
    return resolve(load_config(None, [*base, *overrides]))


def test_each_bad_dataset_line_is_one_bad_row_with_its_own_line_number(tmp_path: Path) -> None:
    """Invalid UTF-8 used to refuse the whole file, deep nesting and lone surrogates to crash the launcher, and a
    U+2028 inside a string (valid JSON) to split its line, shifting every line number after it."""
    lines = [
        b'{"prompt": "1+2=", "answer": "3"}',
        b'{"prompt": "1\xff+2=", "answer": "3"}',
        '{"prompt": "1\u2028+2=", "answer": "3"}'.encode(),
        b'{"prompt": "1+2=", "answer": "3", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": "1\\ud800+2=", "answer": "3"}',
        b'{"prompt": "4+5=", "answer": 9}\r',
    ]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows, bad = read_rows(path)
    assert [(row.line, row.prompt) for row in rows] == [(1, "1+2="), (3, "1\u2028+2="), (6, "4+5=")]
    assert [row.line for row in bad] == [2, 4, 5]
    assert "not UTF-8" in str(bad[0]) and "nested too deeply" in str(bad[1]) and "lone surrogate" in str(bad[2])
    assert bad[0].text.encode(errors="surrogateescape") == lines[1]  # dead-lettered as the bytes it was


def segment(trajectory: str, attempt: str, tokens: list[int], group: PromptGroup | None = GROUP) -> Segment:
    return factories.segment(trajectory_id=trajectory, attempt=attempt, token_ids=tokens, group=group)


def test_a_refused_attempt_does_not_win_its_trajectory() -> None:
    assembler = SegmentAssembler(refuse=lambda segments: "outside" if max(segments[0].token_ids) >= 15 else None)
    poison, real = segment("e0-r1/0", "x:0", [5, 99]), segment("e0-r1/0", "rollout-1:0", [5, 1])
    first = assembler.add(poison, "poison")
    assert first.refused is not None and first.reason == "outside" and first.completed is None
    assert assembler.add(poison, "late copy").released == ["late copy"]
    second = assembler.add(real, "real")
    assert second.completed is not None and second.completed.attempt == "rollout-1:0"


async def test_reward_loop_scores_the_real_attempt_after_a_poison_one_finished_first(tmp_path, model_dir) -> None:
    """Poison completing first used to win the trajectory id: the real attempt was ignored as late, its group never
    completed and the trainer waited for it at its deadline for ever."""
    config = config_for(tmp_path, model_dir, "data.n_samples=2", INLINE_SCORING)
    transport, stop = MemoryTransport(TopicLayout()), asyncio.Event()
    poison = segment("e0-r1/0", "x:0", [5, 99])
    async with transport.outbox() as outbox:
        for message in (poison, segment("e0-r1/0", "rollout-1:0", [5, 1]), segment("e0-r1/1", "rollout-1:1", [6, 1])):
            await outbox.send("segments", message, key=message.trajectory_id)
    scored = lambda: transport.broker.messages("scored", Scored)  # noqa: E731
    task = asyncio.create_task(reward_worker.main(config, stop, transport))
    try:
        for _ in range(1000):
            if len(scored()) == 2 or task.done():
                break
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert sorted((s.trajectory_id, s.attempt) for s in scored()) == [
        ("e0-r1/0", "rollout-1:0"),
        ("e0-r1/1", "rollout-1:1"),
    ]
    [letter] = transport.broker.messages("dead-letter", DeadLetter)
    assert letter.offset == 0 and "the model's vocabulary" in letter.reason
    assert transport.broker.committed[("reward", transport.layout.name("segments"))] == {0: 3}


def scored_of(group: PromptGroup, sample: int, **changes) -> Scored:
    fields = {"attempt": "rollout-1:0", "logprobs": [-0.5, -0.5], "reward": float(sample)} | changes
    return factories.scored(group=group, sample=sample, completion_tokens=[5, 1], **fields)


async def test_trainer_loop_a_forged_trajectory_first_with_another_n_samples_does_not_stall_its_group(
    tmp_path, model_dir
) -> None:
    """The first `scored` record of a group used to decide its n_samples: the real samples then 'differed',
    were dead-lettered, and the trainer waited at the group's deadline for ever. The release decides now."""
    config = config_for(tmp_path, model_dir, "trainer.batch_groups=1", "trainer.max_staleness=0", "trainer.steps=1")
    transport, stop = MemoryTransport(TopicLayout()), asyncio.Event()
    async with transport.outbox() as outbox:
        await outbox.send_now("prompts", GROUP, key=GROUP.prompt_id)
        for record in (scored_of(GROUP, 0, n_samples=3, attempt="x:0"), scored_of(GROUP, 0), scored_of(GROUP, 1)):
            await outbox.send_now("scored", record, key=GROUP.prompt_id)
    task = asyncio.create_task(trainer_worker.main(config, stop, transport))
    try:
        await asyncio.wait_for(asyncio.shield(task), 5)
    except TimeoutError:
        pass
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    manifests = transport.broker.messages("batches", BatchManifest)
    assert [m.trajectory_ids for m in manifests] == [["e0-r1/0", "e0-r1/1"]]
