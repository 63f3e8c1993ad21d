"""Worker loops on the in-memory transport: what each loop promises, in seconds, without a broker.

Integration and e2e tests run the same loops on the real broker; these pin the
loop logic itself (commits, dead letters, interruption, restart) where it is cheap
to set up exactly the situation under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipeline.config import load_config, resolve
from pipeline.demo_model import build_model, build_tokenizer
from schemas.config import RunConfig
from schemas.messages import BatchManifest, DeadLetter, PromptGroup, Scored, Segment, WeightVersion, encode
from tests.factories import scored, text_segment
from topics.memory import MemorySource, MemoryTransport
from topics.names import TopicLayout
from workers import runtime
from workers.reward import worker as reward_worker
from workers.rollout import worker as rollout_worker
from workers.trainer import worker as trainer_worker
from workers.trainer.model import checkpoints_dir
from workers.weights import unique_state_dict, write_version

GROUP = PromptGroup(
    prompt_id="e0-r1",
    row_index=1,
    epoch=0,
    release_index=0,
    released_at_version=3,
    prompt_text="47+8=",
    prompt_tokens=[7, 10, 13],
    answer="55",
    n_samples=2,
)


# the reward loop tests score with the task's own verifier in the loop's process, as the shipped arith config does:
# no scoring process to start (the pool's own tests are in tests/integration)
INLINE_SCORING = "reward.processes=0"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    build_model(path, build_tokenizer(path), seed=0)
    return path


def config_for(tmp_path: Path, model_dir: Path, *overrides: str) -> RunConfig:
    return resolve(
        load_config(
            None,
            [f"runs_dir={tmp_path}", "name=loop", f"model.path={model_dir}", "broker.bootstrap=memory", *overrides],
        )
    )


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting for the worker")


async def run_until(main: Awaitable[None], stop: asyncio.Event, done: Callable[[], bool]) -> None:
    """Run a worker's main until `done()` holds, then stop it and wait for its clean end."""
    task = asyncio.create_task(main)
    try:
        await wait_for(lambda: done() or task.done())
        assert done(), "the worker ended before it got there"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def score(config: RunConfig, transport: MemoryTransport, segments: list, count: int) -> list[Scored]:
    """The segments sent, then the reward loop run until `count` trajectories are scored; those scored."""
    async with transport.outbox() as outbox:
        for message in segments:
            await outbox.send("segments", message, key="k")
    stop = asyncio.Event()
    scored = lambda: transport.broker.messages("scored", Scored)  # noqa: E731
    await run_until(reward_worker.main(config, stop, transport), stop, lambda: len(scored()) == count)
    return scored()


async def test_reward_loop_first_finished_attempt_wins_and_poison_goes_to_dead_letter(tmp_path, model_dir):
    tokenizer = build_tokenizer(model_dir)
    config = config_for(tmp_path, model_dir, "data.n_samples=2", INLINE_SCORING)
    transport = MemoryTransport(TopicLayout())
    broker = transport.broker
    first = [
        text_segment(tokenizer, "5", trajectory_id="e0-r1/0", attempt="a:0", version=3, finish_reason="interrupted", group=GROUP),
        text_segment(tokenizer, "5", trajectory_id="e0-r1/0", attempt="b:0", segment_index=1, version=5),  # before its segment 0
        text_segment(tokenizer, "5", trajectory_id="e0-r1/0", attempt="b:0", version=4, finish_reason="interrupted", group=GROUP),
        text_segment(tokenizer, "6", trajectory_id="e0-r1/0", attempt="a:0", segment_index=1, version=4),  # attempt a finishes late: ignored
    ]  # fmt: skip
    after_poison = text_segment(tokenizer, "54", trajectory_id="e0-r1/1", attempt="b:1", version=4, group=GROUP)
    async with transport.outbox() as outbox:
        for message in first:
            await outbox.send("segments", message, key="k")
        await broker.append(transport.layout.name("segments"), b"\x00poison", b"k", [])
        await outbox.send("segments", after_poison, key="k")

    stop = asyncio.Event()
    scored = lambda: broker.messages("scored", Scored)  # noqa: E731
    await run_until(reward_worker.main(config, stop, transport), stop, lambda: len(scored()) == 2)

    by_id = {s.trajectory_id: s for s in scored()}
    assert by_id["e0-r1/0"].attempt == "b:0" and by_id["e0-r1/0"].versions == [4, 5, 5]
    assert by_id["e0-r1/0"].reward == 1.0 and by_id["e0-r1/1"].reward == 0.0  # the record after the poison
    (letter,) = broker.messages("dead-letter", DeadLetter)
    assert letter.payload == b"\x00poison" and letter.offset == 4 and "not a valid Segment" in letter.reason
    assert broker.committed[("reward", transport.layout.name("segments"))] == {0: 6}  # everything processed


async def test_reward_loop_joins_the_loss_masks_of_tool_segments(tmp_path, model_dir):
    """A tool segment's output tokens (mask 0) stay untrained in `scored`, the reward function reads them, and a
    tool call is no interruption; a trajectory of model tokens only keeps the empty mask."""
    tokenizer = build_tokenizer(model_dir)
    config = config_for(tmp_path, model_dir, "data.n_samples=2", INLINE_SCORING)
    transport = MemoryTransport(TopicLayout())
    call = text_segment(
        tokenizer, "55", trajectory_id="e0-r1/0", attempt="a:0", version=3, finish_reason="tool", group=GROUP
    )  # the model's "5", the tool's "5"
    segments = [
        msgspec.structs.replace(call, loss_mask=[1, 0], logprobs=[-0.5, 0.0]),
        text_segment(tokenizer, "", trajectory_id="e0-r1/0", attempt="a:0", segment_index=1, version=4),  # the model's last turn: eos
        text_segment(tokenizer, "5", trajectory_id="e0-r1/1", attempt="a:1", version=3, finish_reason="interrupted", group=GROUP),
        text_segment(tokenizer, "4", trajectory_id="e0-r1/1", attempt="a:1", segment_index=1, version=4),
    ]  # fmt: skip
    tool, plain = sorted(await score(config, transport, segments, 2), key=lambda s: s.trajectory_id)
    five, eos = tokenizer("5")["input_ids"][0], tokenizer.eos_token_id
    assert (tool.completion_tokens, tool.loss_mask, tool.versions) == ([five, five, eos], [1, 0, 1], [3, 3, 4])
    assert (tool.logprobs, tool.completion_text, tool.reward) == ([-0.5, 0.0, -0.5], "55", 1.0)  # "5" alone: 0
    assert (tool.num_segments, tool.tool_calls, tool.interruptions) == (2, 1, 0)
    assert (plain.loss_mask, plain.num_segments, plain.tool_calls, plain.interruptions) == ([], 2, 0, 1)


async def test_reward_loop_commits_nothing_past_an_unfinished_attempt(tmp_path, model_dir):
    tokenizer = build_tokenizer(model_dir)
    config = config_for(tmp_path, model_dir, "data.n_samples=2", INLINE_SCORING)
    transport = MemoryTransport(TopicLayout())
    segments = [
        text_segment(tokenizer, "5", trajectory_id="e0-r1/0", attempt="a:0", version=3, finish_reason="interrupted", group=GROUP),
        text_segment(tokenizer, "55", trajectory_id="e0-r1/1", attempt="a:1", version=3, group=GROUP),
    ]  # fmt: skip
    await score(config, transport, segments, 1)
    # offset 0 (an attempt still waiting for its end) is not processed: a restart must read it again
    assert transport.broker.committed[("reward", transport.layout.name("segments"))] == {0: 0}


class GatedEngine:
    """The real engine, pausing at decode step `gate_at` (if not 0) until the test opens the gate: meanwhile it
    says it is idle, and the worker's loop goes on around it without stepping."""

    def __init__(self, engine, gate_at: int):
        self.engine, self.gate_at, self.steps = engine, gate_at, 0
        self.reached, self.gate = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def paused(self) -> bool:
        return bool(self.gate_at) and self.steps >= self.gate_at and not self.gate.is_set()

    def idle(self) -> bool:
        return self.paused() or self.engine.idle()

    def step(self):
        self.steps += 1
        if self.paused():
            self.reached.set()
            return []
        return self.engine.step()


def rollout_setup(tmp_path, model_dir, monkeypatch, gate_at: int, wrap=lambda engine: engine, *overrides: str):
    """A rollout config, and the worker's engine (once made) as a GatedEngine around `wrap(the real engine)`."""
    config = config_for(
        tmp_path, model_dir, "data.n_samples=2", "rollout.max_new_tokens=100", "rollout.top_k=3", *overrides
    )
    gated: list[GatedEngine] = []

    def make_gated_engine(cfg):
        gated.append(GatedEngine(wrap(real_make_engine(cfg)), gate_at))
        return gated[0]

    real_make_engine = rollout_worker.make_engine
    monkeypatch.setattr(rollout_worker, "make_engine", make_gated_engine)
    return config, gated


def announce(config: RunConfig, version: int, seed: int, corrupt: bool = False) -> WeightVersion:
    """Weights of another model written as the trainer writes them; `corrupt` flips a byte after hashing."""
    model = AutoModelForCausalLM.from_pretrained(config.model.path)
    torch.manual_seed(seed)
    for parameter in model.parameters():
        parameter.data.add_(torch.randn_like(parameter) * 0.5)
    path, digest = write_version(unique_state_dict(model), runtime.weights_dir(config), version, keep=8)
    if corrupt:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    return WeightVersion(
        version=version, uri=str(path), content_hash=digest, step=version, groups_consumed=0, groups_dropped=0
    )


@contextlib.asynccontextmanager
async def rollout_running(config: RunConfig, transport: MemoryTransport, model_dir: Path):
    """The rollout worker's loop running, with one group (prompt `47+8=`, released at version 0) on `prompts`;
    yields an outbox and the group, stops the loop on leaving."""
    stop = asyncio.Event()
    group = msgspec.structs.replace(
        GROUP, released_at_version=0, prompt_tokens=build_tokenizer(model_dir)("47+8=")["input_ids"]
    )
    async with transport.outbox() as outbox:
        await outbox.send_now("prompts", group, key=group.prompt_id)
        task = asyncio.create_task(rollout_worker.main(config, stop, transport))
        try:
            yield outbox, group
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)


async def test_rollout_loop_a_new_version_interrupts_and_the_group_commits_when_all_are_out(
    tmp_path, model_dir, monkeypatch
):
    config, gated = rollout_setup(tmp_path, model_dir, monkeypatch, gate_at=4)
    monkeypatch.setattr(rollout_worker, "METRICS_PERIOD_S", 0.0)  # a metrics line after every step
    transport = MemoryTransport(TopicLayout())
    prompts = transport.layout.name("prompts")
    segments = lambda: transport.broker.messages("segments", Segment)  # noqa: E731
    async with rollout_running(config, transport, model_dir) as (outbox, group):
        await wait_for(lambda: bool(gated) and gated[0].reached.is_set())
        await outbox.send_now("weights", announce(config, 1, seed=1))
        await asyncio.sleep(0.6)  # past a commit period while the group is in flight
        assert transport.broker.committed.get(("rollout", prompts), {}).get(0, 0) == 0
        gated[0].gate.set()
        await wait_for(lambda: sum(s.finish_reason != "interrupted" for s in segments()) == 2)
    for sample in ("e0-r1/0", "e0-r1/1"):
        parts = [s for s in segments() if s.trajectory_id == sample]
        assert parts[0].finish_reason == "interrupted" and len(parts) == 2
        assert [s.version for s in parts] == [0, 1] and len(parts[0].token_ids) == 3  # paused after 3 steps at v0
        assert parts[0].group == group and parts[1].group is None and parts[1].segment_index == 1
    assert gated[0].engine.version == 1
    assert transport.broker.committed[("rollout", prompts)] == {0: 1}  # all trajectories out: committed
    lines = [json.loads(line) for line in (runtime.run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    last = [line for line in lines if line["source"] == "rollout"][-1]
    assert last["engine_steps"] == gated[0].steps  # every step the worker ran, the paused one included
    assert last["engine_tokens"] == gated[0].engine.stats().generated_tokens > 0 and last["engine_seconds"] > 0


class ThreadRecorder:
    """The real engine, noting for each step whether it prefilled and whether it ran on the loop's thread."""

    def __init__(self, engine):
        self.engine, self.loop_thread, self.steps = engine, threading.main_thread().ident, []  # the loop runs there

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        engine = self.engine  # slots to prefill lie between the decoding ones and the followers (engine.leads)
        prefills = engine.decoding + len(engine.leads) < len(engine.slots) or bool(engine.waiting)
        self.steps.append((prefills, threading.get_ident() == self.loop_thread))
        return self.engine.step()


@pytest.mark.parametrize("cache_lag", [0, 1])
async def test_rollout_loop_decodes_on_its_own_thread_and_prefills_in_another(
    tmp_path, model_dir, monkeypatch, cache_lag
):
    """Decode steps run on the loop's thread (no hand-over per step); steps that prefill (the admitted group,
    every running sequence after a weight load that recomputes caches) run in a thread, so that the loop never
    stops for long."""
    config, gated = rollout_setup(tmp_path, model_dir, monkeypatch, 4, ThreadRecorder, f"rollout.cache_lag={cache_lag}")
    async with rollout_running(config, MemoryTransport(TopicLayout()), model_dir) as (outbox, _):
        await wait_for(lambda: bool(gated) and gated[0].reached.is_set())
        await outbox.send_now("weights", announce(config, 1, seed=1))
        await wait_for(lambda: gated[0].engine.version == 1)
        gated[0].gate.set()
        await wait_for(lambda: len(gated[0].engine.steps) >= 5)
    steps = gated[0].engine.steps
    recomputed = cache_lag == 0  # else the caches made at v0 may lag v1: nothing to recompute
    assert [prefills for prefills, _ in steps[:5]] == [True, False, False, recomputed, False]  # admission; update
    assert all(on_loop != prefills for prefills, on_loop in steps)


async def test_rollout_loop_refuses_a_corrupted_weight_file_and_keeps_its_weights(tmp_path, model_dir, monkeypatch):
    config, gated = rollout_setup(tmp_path, model_dir, monkeypatch, gate_at=0)
    transport, stop = MemoryTransport(TopicLayout()), asyncio.Event()
    letters = lambda: transport.broker.messages("dead-letter", DeadLetter)  # noqa: E731
    missing = msgspec.structs.replace(announce(config, 2, seed=2), uri=str(tmp_path / "gone.safetensors"))
    async with transport.outbox() as outbox:
        await outbox.send_now("weights", announce(config, 1, seed=1, corrupt=True))
        task = asyncio.create_task(rollout_worker.main(config, stop, transport))
        try:
            await wait_for(lambda: len(letters()) == 1)
            assert gated[0].engine.version == 0
            await outbox.send_now("weights", missing)
            await wait_for(lambda: len(letters()) == 2)
            await outbox.send_now("weights", announce(config, 3, seed=3))
            await wait_for(lambda: gated[0].engine.version == 3)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    corrupted, gone = letters()
    assert "sha256" in corrupted.reason and corrupted.source == transport.layout.name("weights")
    assert msgspec.msgpack.decode(corrupted.payload, type=WeightVersion).version == 1
    assert "does not exist" in gone.reason


def released(n: int, version: int) -> PromptGroup:
    return msgspec.structs.replace(GROUP, prompt_id=f"p{n}", release_index=n, released_at_version=version)


async def publish(transport: MemoryTransport, *messages) -> None:
    async with transport.outbox() as outbox:
        for message in messages:
            role = "prompts" if isinstance(message, PromptGroup) else "scored"
            await outbox.send_now(role, message, key=message.prompt_id)


async def test_trainer_loop_waits_for_a_straggler_at_its_staleness_deadline(tmp_path, model_dir):
    config = config_for(tmp_path, model_dir, "trainer.batch_groups=1", "trainer.max_staleness=1", "trainer.steps=3")
    transport, stop = MemoryTransport(TopicLayout()), asyncio.Event()
    a, b, c = released(0, 0), released(1, 0), released(2, 1)
    await publish(
        transport,
        a,
        b,
        c,
        scored(group=a, sample=0, reward=1.0),
        *(scored(group=b, sample=i, reward=i) for i in (0, 1)),
        *(scored(group=c, sample=i, reward=i) for i in (0, 1)),
    )
    manifests = lambda: transport.broker.messages("batches", BatchManifest)  # noqa: E731
    task = asyncio.create_task(trainer_worker.main(config, stop, transport))
    try:
        await wait_for(lambda: len(manifests()) == 1)
        await asyncio.sleep(0.5)  # at v1 group a (released at v0, eta 1) is due and incomplete: c must wait
        assert [m.trajectory_ids for m in manifests()] == [["p1/0", "p1/1"]]
        await publish(transport, scored(group=a, sample=1, reward=0.0))
        await asyncio.wait_for(task, 20)  # a, then c: the run ends after 3 steps
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert [m.trajectory_ids for m in manifests()] == [["p1/0", "p1/1"], ["p0/0", "p0/1"], ["p2/0", "p2/1"]]
    assert all(not m.dropped for m in manifests())
    assert transport.broker.messages("weights", WeightVersion)[-1].final
    lines = [json.loads(line) for line in (runtime.run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    waits = [(line["time_wait"], line["time_wait_due"]) for line in lines if "time_wait_due" in line]
    assert len(waits) == 3 and waits[0][1] == waits[2][1] == 0.0  # nothing due was missing before a and c
    assert 0.2 < waits[1][1] <= waits[1][0] < 2 * waits[1][1], waits  # a held the ready c back: most of the wait


async def test_trainer_loop_steps_on_without_waiting_for_records_while_a_batch_is_ready(
    tmp_path, model_dir, monkeypatch
):
    """A step never waits for the next record to arrive when the buffer already holds its batch (it did: 45 ms
    a step, about a third of the demo's steps, before this was pinned)."""
    config = config_for(tmp_path, model_dir, "trainer.batch_groups=1", "trainer.max_staleness=4", "trainer.steps=3")
    transport = MemoryTransport(TopicLayout())
    groups = [released(n, 0) for n in range(3)]
    await publish(transport, *groups, *(scored(group=g, sample=i, reward=float(i)) for g in groups for i in (0, 1)))
    waits, fetch = [], MemorySource.fetch

    async def counted(source: MemorySource, timeout_s: float, max_records: int | None) -> list:
        records = await fetch(source, timeout_s, max_records)
        if source.topic.endswith("scored") and timeout_s > 0 and not records:
            waits.append(timeout_s)  # waited the whole timeout for a record that never came
        return records

    monkeypatch.setattr(MemorySource, "fetch", counted)
    await asyncio.wait_for(trainer_worker.main(config, asyncio.Event(), transport), 30)
    assert [m.step for m in transport.broker.messages("batches", BatchManifest)] == [1, 2, 3]
    assert waits == []


async def test_trainer_loop_restart_rebuilds_the_steps_after_its_checkpoint_from_their_manifests(tmp_path, model_dir):
    config = config_for(
        tmp_path,
        model_dir,
        "trainer.batch_groups=1",
        "trainer.max_staleness=4",
        "trainer.steps=3",
        "trainer.checkpoint.every=2",
        "trainer.optim.lr=1e-2",
    )
    transport = MemoryTransport(TopicLayout())
    groups = [released(n, 0) for n in range(3)]
    await publish(
        transport,
        *groups,
        *(scored(group=g, sample=i, reward=float(i == n % 2)) for n, g in enumerate(groups) for i in (0, 1)),
    )
    stop = asyncio.Event()
    await asyncio.wait_for(trainer_worker.main(config, stop, transport), 30)
    straight = load_file(runtime.weights_dir(config) / "v000003.safetensors")
    # the process "died" after step 3's manifest, before its checkpoint: only step 2's is left
    final = max(checkpoints_dir(config).iterdir())
    final.unlink()
    await asyncio.wait_for(trainer_worker.main(config, asyncio.Event(), transport), 30)
    manifests = transport.broker.messages("batches", BatchManifest)
    assert [m.step for m in manifests] == [1, 2, 3]  # step 3 redone from its manifest, no new one written
    redone = load_file(runtime.weights_dir(config) / "v000003.safetensors")
    assert all(torch.equal(straight[name], redone[name]) for name in straight)  # bit for bit
    assert max(checkpoints_dir(config).iterdir()).name == final.name


async def test_rollout_loop_dead_letters_poisoned_prompts_and_generates_the_next_one(tmp_path, model_dir):
    config = config_for(tmp_path, model_dir, "data.n_samples=2", "rollout.max_new_tokens=4")
    transport, stop = MemoryTransport(TopicLayout()), asyncio.Event()
    tokens = build_tokenizer(model_dir)("47+8=")["input_ids"]
    good = msgspec.structs.replace(GROUP, released_at_version=0, prompt_tokens=tokens)
    outside = encode(msgspec.structs.replace(good, prompt_id="huge", prompt_tokens=[*tokens, 10**9]))
    no_samples = encode(msgspec.structs.replace(good, prompt_id="none", n_samples=0))
    not_utf8 = encode(msgspec.structs.replace(good, prompt_id="utf8")).replace(b"utf8", b"\xff\xfe\xfd\xfc")
    prompts = transport.layout.name("prompts")
    for value in (outside, no_samples, not_utf8, encode(good)):
        await transport.broker.append(prompts, value, b"k", [])
    segments = lambda: transport.broker.messages("segments", Segment)  # noqa: E731
    await run_until(
        rollout_worker.main(config, stop, transport),
        stop,
        lambda: sum(s.finish_reason != "interrupted" for s in segments()) == 2,
    )
    reasons = {letter.payload: letter.reason for letter in transport.broker.messages("dead-letter", DeadLetter)}
    assert set(reasons) == {outside, no_samples, not_utf8}
    assert "prompt_tokens must lie in [0, 15) (the model's vocabulary)" in reasons[outside]
    assert "n_samples is 0" in reasons[no_samples] and "UnicodeDecodeError" in reasons[not_utf8]
    assert {s.trajectory_id for s in segments()} == {"e0-r1/0", "e0-r1/1"}  # only the good group generated
    assert transport.broker.committed[("rollout", prompts)] == {0: 4}  # the poison counts as processed


async def test_trainer_loop_dead_letters_what_it_cannot_train_and_trains_the_rest(tmp_path, model_dir):
    config = config_for(tmp_path, model_dir, "trainer.batch_groups=1", "trainer.max_staleness=4", "trainer.steps=1")
    transport = MemoryTransport(TopicLayout())
    group, outside = released(0, 0), msgspec.structs.replace(released(1, 0), prompt_tokens=[7, 10**6])
    good = [scored(group=group, sample=i, reward=float(i)) for i in (0, 1)]
    poison = {
        "logprobs[1] is nan": msgspec.structs.replace(good[0], logprobs=[-1.0, math.nan, -1.0]),
        "1 logprobs for 3 completion_tokens": msgspec.structs.replace(good[0], logprobs=[-1.0]),
        "reward is nan": msgspec.structs.replace(good[0], reward=math.nan),
        "completion_tokens must lie in [0, 15)": msgspec.structs.replace(good[1], completion_tokens=[5, 6, 10**6]),
        "n_samples 3 differs from its release's 2": msgspec.structs.replace(good[1], n_samples=3),
    }
    await publish(transport, group, outside, *list(poison.values())[:3], good[0], *list(poison.values())[3:], good[1])
    await asyncio.wait_for(trainer_worker.main(config, asyncio.Event(), transport), 30)
    [manifest] = transport.broker.messages("batches", BatchManifest)
    assert manifest.trajectory_ids == ["p0/0", "p0/1"]  # none of the poison trained
    assert manifest.dropped == []  # a release outside the model is forged: it waits for nothing, counts as no drop
    reasons = {letter.payload: letter.reason for letter in transport.broker.messages("dead-letter", DeadLetter)}
    assert len(reasons) == 6 and "the model's vocabulary" in reasons[encode(outside)]
    assert all(expected in reasons[encode(record)] for expected, record in poison.items()), reasons
    [step] = [json.loads(line) for line in (runtime.run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(v) for v in step.values() if isinstance(v, float)), step


class SlowLoad:
    """The real engine, its weight load taking a while on the loader's thread, noting when that load returned."""

    def __init__(self, engine):
        self.engine, self.loaded = engine, threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update_weights(self, weights):
        time.sleep(0.5)
        self.engine.update_weights(weights)
        self.loaded.set()


async def test_rollout_loop_that_fails_to_emit_during_a_load_ends_after_the_load(tmp_path, model_dir, monkeypatch):
    """An interrupted segment that cannot be sent ends the worker with that error, but only once the weight load
    running meanwhile on another thread has returned: no thread is left writing into the model."""
    config, gated = rollout_setup(tmp_path, model_dir, monkeypatch, 4, SlowLoad)
    real_emit = rollout_worker.Rollout.emit

    async def emit(self, seq, finish_reason, key=""):
        if finish_reason == "interrupted":
            raise ConnectionError("broker gone")
        return await real_emit(self, seq, finish_reason, key)

    monkeypatch.setattr(rollout_worker.Rollout, "emit", emit)
    transport, stop = MemoryTransport(TopicLayout()), asyncio.Event()
    group = msgspec.structs.replace(GROUP, released_at_version=0)
    async with transport.outbox() as outbox:
        await outbox.send_now("prompts", group, key=group.prompt_id)
        task = asyncio.create_task(rollout_worker.main(config, stop, transport))
        await wait_for(lambda: bool(gated) and gated[0].reached.is_set())
        await outbox.send_now("weights", announce(config, 1, seed=1))
        with pytest.raises(ConnectionError, match="broker gone"):
            await asyncio.wait_for(task, 10)
    assert gated[0].engine.loaded.is_set()  # the load had returned when the worker ended
    assert gated[0].engine.version == 1
