"""Non-finite updates are skipped, not applied; non-finite weights are never published; the trainer's
versions go on, contiguous, with the skipped steps counted, each announced in order after its manifest."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import load_config, resolve
from schemas.messages import BatchManifest, DroppedGroup, PromptGroup, Scored, WeightVersion, prompt_id_of
from tests.factories import scored, tiny_qwen2
from topics.memory import MemoryBroker, MemorySink, MemoryTransport
from topics.names import TopicLayout
from topics.transport import decode_or_error
from workers import runtime
from workers.trainer import step as step_module
from workers.trainer import worker as trainer_worker
from workers.trainer.buffer import GroupBuffer
from workers.trainer.checkpoint import TrainerState
from workers.trainer.losses import LossSettings
from workers.trainer.model import Trainer
from workers.trainer.step import StepSettings, collate, train_step
from workers.weights import NonFiniteWeights, non_finite, write_version

SEQS = [([3, 4, 5], [6, 7], [-1.0, -2.0]), ([3, 4], [8, 9, 1], [-0.5, -0.25, -3.0]), ([5], [6], [-1.5])]
SETTINGS = StepSettings(decoupled=True, minibatches=1, grad_clip=1.0, temperature=1.0, loss=LossSettings(clip_eps=0.2))


def step(model, advantages, settings=SETTINGS):
    """One step on SEQS; the stats, the weights before and after, and the optimizer."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    stats = train_step(model, optimizer, collate(SEQS, advantages, pad_id=0), settings)
    return stats, before, model.state_dict(), optimizer


def unchanged(before: dict, after: dict) -> bool:
    return all(torch.equal(before[name], after[name]) for name in before)


def test_a_nan_loss_skips_the_update_and_leaves_weights_and_optimizer_as_they_were():
    model = tiny_qwen2()
    stats, before, after, optimizer = step(model, [1.0, math.nan, 0.25])
    assert stats["skipped_updates"] == 1 and stats["skip_reason"] == "minibatch 0: loss is nan"
    assert unchanged(before, after)
    assert not optimizer.state  # AdamW never stepped: no moments, no step count
    assert all(p.grad is None for p in model.parameters())  # the NaN gradients are gone too


def test_an_inf_gradient_norm_skips_the_update():
    model = tiny_qwen2()
    model.get_input_embeddings().weight.register_hook(lambda grad: torch.full_like(grad, math.inf))
    stats, before, after, _ = step(model, [1.0, -0.5, 0.25])
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] == math.inf
    assert stats["skip_reason"] == "minibatch 0: gradient norm is inf"
    assert unchanged(before, after)


def test_a_finite_step_is_applied_and_only_the_bad_minibatch_is_skipped():
    stats, before, after, _ = step(tiny_qwen2(), [1.0, -0.5, 0.25])
    assert stats["skipped_updates"] == 0 and "skip_reason" not in stats and not unchanged(before, after)
    two = dataclasses.replace(SETTINGS, minibatches=2)
    stats, before, after, _ = step(tiny_qwen2(), [1.0, -0.5, math.nan], two)  # rows 0, 1 | row 2
    assert stats["skipped_updates"] == 1 and stats["skip_reason"] == "minibatch 1: loss is nan"
    assert not unchanged(before, after)  # the first minibatch's update stands


def test_write_version_refuses_nan_or_inf_and_writes_nothing(tmp_path):
    good = {"a": torch.ones(2), "ids": torch.tensor([1, 2])}
    for bad in (torch.tensor([1.0, math.nan]), torch.tensor([math.inf, 0.0]).to(torch.bfloat16)):
        with pytest.raises(NonFiniteWeights, match=r"weights v3 not published: NaN or inf in 1 tensors \(b, ...\)"):
            write_version({**good, "b": bad}, tmp_path, 3, keep=2)
    assert not list(tmp_path.iterdir())
    path, _ = write_version(good, tmp_path, 3, keep=2)
    assert torch.equal(load_file(path)["a"], good["a"])


def test_non_finite_names_exactly_the_tensors_with_nan_or_inf_even_where_a_finite_sum_overflows():
    huge = torch.full((4,), 3e38)  # finite, but its sum is inf: the fast check alone would refuse it
    tensors = {"a": torch.ones(3), "huge": huge, "ids": torch.tensor([1, 2]), "nan": torch.tensor([0.0, math.nan])}
    tensors["inf"] = torch.tensor([-math.inf, 1.0]).to(torch.bfloat16)
    assert non_finite(tensors) == ["nan", "inf"]
    assert non_finite({"a": torch.ones(3), "huge": huge}) == [] and non_finite({}) == []


def guard_config(tmp_path, model_dir, steps: int, overrides=()):
    """A trainer of one group of 2 samples per step, on the in-memory broker."""
    overrides = [*overrides, "name=guard", f"model.path={model_dir}", "broker.bootstrap=memory"]
    overrides += [f"runs_dir={tmp_path}", "trainer.batch_groups=1", "data.n_samples=2", f"trainer.steps={steps}"]
    return resolve(load_config(None, overrides))


async def send_groups(transport: MemoryTransport, rewards, first: int = 0, finish=None) -> None:
    """Groups p<first>, p<first + 1>, ... released at version 0 and scored, one per (reward, reward) pair; `finish`:
    a (finish reason, finish reason) pair per group (default: both stopped)."""
    async with transport.outbox() as outbox:
        for n, pair, reasons in zip(itertools.count(first), rewards, finish or [("stop", "stop")] * len(rewards)):
            group = PromptGroup(
                prompt_id=f"p{n}", row_index=n, epoch=0, release_index=n, released_at_version=0, prompt_text="47+8=",
                prompt_tokens=[7, 10, 13], answer="55", n_samples=2,
            )  # fmt: skip
            await outbox.send_now("prompts", group, key=group.prompt_id)
            for sample, reward in enumerate(pair):
                completion = [5 + sample, 6, 1]  # the same answer twice, at rewards 0 and 1, would train nothing
                record = scored(
                    group=group,
                    sample=sample,
                    reward=reward,
                    completion_tokens=completion,
                    finish_reason=reasons[sample],
                )
                await outbox.send_now("scored", record, key=group.prompt_id)


async def run_trainer_on_two_groups(
    tmp_path, model_dir, transport: MemoryTransport, steps: int = 2, rewards=None, overrides=()
):
    """The trainer loop for `steps` steps of one group of 2 samples, from an in-memory broker holding a group
    per (reward, reward) pair of `rewards` (default: `steps` groups scored 0 and 1); its config."""
    config = guard_config(tmp_path, model_dir, steps, overrides)
    await send_groups(transport, rewards or [(0.0, 1.0)] * steps)
    await asyncio.wait_for(trainer_worker.main(config, asyncio.Event(), transport), 60)
    return config


async def test_trainer_loop_skips_non_finite_steps_yet_publishes_every_version(tmp_path, demo_model_dir, monkeypatch):
    """Every update has an inf gradient norm: the batches are consumed, versions 1 and 2 are announced with
    the initial weights bit for bit, and the metrics count the skipped steps."""
    monkeypatch.setattr(step_module, "clip_gradients", lambda model, max_norm: math.inf)
    transport = MemoryTransport(TopicLayout())
    config = await run_trainer_on_two_groups(tmp_path, demo_model_dir, transport)

    assert [m.step for m in transport.broker.messages("batches", BatchManifest)] == [1, 2]
    announced = transport.broker.messages("weights", WeightVersion)
    assert [a.version for a in announced] == [0, 1, 2] and announced[-1].final
    initial, *later = [load_file(a.uri) for a in announced]
    assert all(unchanged(initial, version) for version in later)  # published, with the weights never changed
    lines = [json.loads(line) for line in (runtime.run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["skipped_updates"], line["skipped_steps"]) for line in lines] == [(1, 1, 1), (2, 1, 2)]


async def test_the_metrics_count_the_trajectories_cut_at_the_output_budget(tmp_path, demo_model_dir):
    """`truncated`: a step's trajectories that ended at rollout.max_new_tokens; `truncated_trajectories`: the run's."""
    transport = MemoryTransport(TopicLayout())
    config = guard_config(tmp_path, demo_model_dir, 2, ())
    await send_groups(transport, [(0.0, 1.0)] * 2, finish=[("length", "stop"), ("length", "length")])
    await asyncio.wait_for(trainer_worker.main(config, asyncio.Event(), transport), 60)
    lines = [json.loads(line) for line in (runtime.run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["truncated"], line["truncated_trajectories"]) for line in lines] == [
        (1, 1, 1),
        (2, 2, 3),
    ]


async def test_a_version_is_announced_after_its_manifest_and_after_the_version_before(
    tmp_path, demo_model_dir, monkeypatch
):
    """Weights are written and announced while the next step trains: each announcement still waits for the
    previous version's and for its own step's manifest, here delivered 0.3 s late, and names the weights that
    step made (not those of a later step)."""
    order: list[tuple[str, int]] = []  # (topic role, step or version) in the order the broker got them
    append = MemoryBroker.append

    async def recorded(self, topic, value, key, headers):
        for role, cls in (("batches", BatchManifest), ("weights", WeightVersion)):
            if topic == self.layout.name(role):
                message = decode_or_error(value, cls)
                order.append((role, message.step))
        return await append(self, topic, value, key, headers)

    async def late(self, topic, value, key, headers):
        if topic != self.broker.layout.name("batches"):
            return await send(self, topic, value, key, headers)
        delivered = asyncio.get_running_loop().create_future()

        async def deliver():
            await asyncio.sleep(0.3)
            delivered.set_result(await self.broker.append(topic, value, key, headers))

        pending.append(asyncio.create_task(deliver()))
        return delivered

    send, pending = MemorySink.send, []
    monkeypatch.setattr(MemoryBroker, "append", recorded)
    monkeypatch.setattr(MemorySink, "send", late)
    transport = MemoryTransport(TopicLayout())
    await run_trainer_on_two_groups(tmp_path, demo_model_dir, transport, steps=3)

    assert [entry for entry in order if entry[0] == "weights"] == [("weights", v) for v in range(4)]
    for version in (1, 2, 3):
        assert order.index(("batches", version)) < order.index(("weights", version))
    announced = transport.broker.messages("weights", WeightVersion)
    versions = [load_file(a.uri) for a in announced]
    assert not any(unchanged(a, b) for a, b in itertools.pairwise(versions))  # every step changed the weights


async def test_with_skip_uniform_groups_a_group_without_advantage_is_recorded_dropped_and_never_trained(
    tmp_path, demo_model_dir, monkeypatch
):
    written, publish = [], Trainer.publish
    monkeypatch.setattr(Trainer, "publish", lambda self, *args: written.append(args[1]) or publish(self, *args))
    transport = MemoryTransport(TopicLayout())
    rewards = [(1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (1.0, 0.0)]  # p0 and p2 have no advantage
    await run_trainer_on_two_groups(
        tmp_path, demo_model_dir, transport, steps=2, rewards=rewards, overrides=["trainer.skip_uniform_groups=2"]
    )
    manifests = transport.broker.messages("batches", BatchManifest)
    assert [sorted({prompt_id_of(t) for t in m.trajectory_ids}) for m in manifests] == [["p1"], ["p3"]]
    dropped = [(d.prompt_id, d.reason) for m in manifests for d in m.dropped]
    assert dropped == [
        ("p0", "uniform: all 2 samples scored 1 (no advantage)"),
        ("p2", "uniform: all 2 samples scored 0 (no advantage)"),
    ]
    assert [m.uniform for m in manifests] == [["p0", "p2"], []]  # both dropped before the first step: no advantage
    announced = transport.broker.messages("weights", WeightVersion)
    assert announced[-1].groups_dropped == 2 and announced[-1].groups_consumed == 2
    assert [a.version for a in announced] == [0, 0, 1, 2]  # drops announce their version's file again...
    assert [a.groups_skipped for a in announced] == [0, 2, 2, 2]  # (the source releases ahead of these)
    assert written == [0, 1, 2]  # ...without writing it again


async def test_a_drop_pending_at_a_stop_is_kept_by_its_checkpoint_and_recorded_by_the_restarted_trainer(
    tmp_path, demo_model_dir
):
    """Stopped after dropping p1 (no advantage) and before any manifest records it: the stop's checkpoint keeps
    the drop, and the trainer restarted from it records it in its first manifest and counts it, although it
    reads `scored` from past p1's records (a trainer that left the drop to be redone waited for them)."""
    transport = MemoryTransport(TopicLayout())
    config = guard_config(tmp_path, demo_model_dir, steps=2, overrides=["trainer.skip_uniform_groups=2"])

    async def announced(predicate) -> None:
        while not any(predicate(a) for a in transport.broker.messages("weights", WeightVersion)):
            await asyncio.sleep(0.01)

    await send_groups(transport, [(0.0, 1.0)])  # p0, trained at step 1
    stop = asyncio.Event()
    first = asyncio.create_task(trainer_worker.main(config, stop, transport))
    await asyncio.wait_for(announced(lambda a: a.version == 1), 60)
    await send_groups(transport, [(1.0, 1.0)], first=1)  # p1: dropped after step 1's manifest
    await asyncio.wait_for(announced(lambda a: a.groups_dropped == 1), 60)  # drops are announced at once
    stop.set()
    await asyncio.wait_for(first, 60)
    assert [m.step for m in transport.broker.messages("batches", BatchManifest)] == [1]  # p1 is in none yet

    await send_groups(transport, [(0.0, 1.0)], first=2)  # p2, for step 2
    await asyncio.wait_for(trainer_worker.main(config, asyncio.Event(), transport), 60)
    manifests = transport.broker.messages("batches", BatchManifest)
    assert [sorted({prompt_id_of(t) for t in m.trajectory_ids}) for m in manifests] == [["p0"], ["p2"]]
    assert [[d.prompt_id for d in m.dropped] for m in manifests] == [[], ["p1"]]
    final = transport.broker.messages("weights", WeightVersion)[-1]
    assert (final.version, final.final, final.groups_dropped, final.groups_consumed) == (2, True, 1, 2)
    assert final.groups_skipped == 1  # counted again from the manifest that records the drop


def test_restore_keeps_the_checkpoints_pending_drops_that_no_manifest_has_recorded():
    reason = "uniform: all 2 samples scored 1 (no advantage)"
    state = TrainerState(step=1, done_prompts=["p0", "p1", "p2"], pending_drops=[("p1", reason), ("p2", reason)])
    manifest = BatchManifest(
        step=2, trainer_version=1, trajectory_ids=["p3/0", "p3/1"], scored_offsets=[(0, 6), (0, 7)],
        consumed_offsets=[], dropped=[DroppedGroup(prompt_id="p1", reason=reason)],
    )  # fmt: skip
    redo, buffer, pending = trainer_worker.restore([manifest], state)
    assert redo == [manifest]  # written after the checkpoint: it records p1, so p1 is no longer pending
    assert pending == [DroppedGroup(prompt_id="p2", reason=reason)]
    assert {"p0", "p1", "p2"} <= buffer.done_prompts and "p3" not in buffer.done_prompts  # the redo trains p3


def test_restore_redoes_the_manifests_in_step_order_whatever_order_batches_gave_them():
    """`batches` with two partitions is read partition by partition (steps 6, 10, 7, 8, 9 in a chaos run): a redo
    in that order trained step 10's groups as step 7, with a staleness of -2."""
    manifests = [
        BatchManifest(
            step=step,
            trainer_version=step - 1,
            trajectory_ids=[f"p{step}/0"],
            scored_offsets=[(step % 2, step)],
            consumed_offsets=[],
        )
        for step in (4, 6, 10, 5, 7, 8, 9)
    ]
    redo, _, _ = trainer_worker.restore(manifests, TrainerState(step=5))
    assert [m.step for m in redo] == [6, 7, 8, 9, 10]


def test_a_manifest_lists_the_groups_without_advantage_it_trains_and_drops():
    buffer = GroupBuffer()  # u0: both samples scored 1; m1: one scored 0, an advantage
    for index, (prompt_id, rewards) in enumerate([("u0", (1.0, 1.0)), ("m1", (1.0, 0.0))]):
        for sample, reward in enumerate(rewards):
            trajectory = Scored(
                trajectory_id=f"{prompt_id}/{sample}", prompt_id=prompt_id, sample_index=sample, n_samples=2,
                release_index=index, released_at_version=0, attempt="w:0", prompt_tokens=[1], completion_tokens=[2],
                logprobs=[-0.5], versions=[0], finish_reason="stop", num_segments=1, reward=reward,
            )  # fmt: skip
            buffer.add(trajectory, (0, 2 * index + sample))
    batch, _ = buffer.take(2, 0, 4)
    drop = DroppedGroup(prompt_id="u9", reason="uniform: all 2 samples scored 0 (no advantage)")
    stale = DroppedGroup(prompt_id="s8", reason="stale: released at v0, trainer at v5, staleness 5 > max_staleness 4")
    manifest = trainer_worker.new_manifest(batch, 0, {}, [drop, stale])
    assert manifest.uniform == ["u0", "u9"]  # trained without advantage, then dropped for it; never the stale one
