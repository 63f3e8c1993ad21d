"""Non-finite updates are skipped, not applied; non-finite weights are never published; the trainer's
versions go on, contiguous, with the skipped steps counted."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import load_config, resolve
from schemas.messages import BatchManifest, PromptGroup, Scored, WeightVersion
from topics.memory import MemoryTransport
from topics.names import TopicLayout
from workers import runtime
from workers.trainer import step as step_module
from workers.trainer import worker as trainer_worker
from workers.trainer.losses import LossSettings
from workers.trainer.step import StepSettings, collate, train_step
from workers.weights import NonFiniteWeights, write_version

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


def test_a_nan_loss_skips_the_update_and_leaves_weights_and_optimizer_as_they_were(tiny_qwen2):
    model = tiny_qwen2()
    stats, before, after, optimizer = step(model, [1.0, math.nan, 0.25])
    assert stats["skipped_updates"] == 1 and stats["skip_reason"] == "minibatch 0: loss is nan"
    assert unchanged(before, after)
    assert not optimizer.state  # AdamW never stepped: no moments, no step count
    assert all(p.grad is None for p in model.parameters())  # the NaN gradients are gone too


def test_an_inf_gradient_norm_skips_the_update(tiny_qwen2):
    model = tiny_qwen2()
    model.get_input_embeddings().weight.register_hook(lambda grad: torch.full_like(grad, math.inf))
    stats, before, after, _ = step(model, [1.0, -0.5, 0.25])
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] == math.inf
    assert stats["skip_reason"] == "minibatch 0: gradient norm is inf"
    assert unchanged(before, after)


def test_a_finite_step_is_applied_and_only_the_bad_minibatch_is_skipped(tiny_qwen2):
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


def scored(group: PromptGroup, sample: int, reward: float) -> Scored:
    return Scored(
        trajectory_id=f"{group.prompt_id}/{sample}",
        prompt_id=group.prompt_id,
        sample_index=sample,
        n_samples=group.n_samples,
        release_index=group.release_index,
        released_at_version=group.released_at_version,
        attempt="a",
        prompt_tokens=[7, 10, 13],
        completion_tokens=[5, 6, 1],
        logprobs=[-1.0] * 3,
        versions=[0] * 3,
        finish_reason="stop",
        num_segments=1,
        reward=reward,
    )


async def test_trainer_loop_skips_non_finite_steps_yet_publishes_every_version(tmp_path, demo_model_dir, monkeypatch):
    """Every update has an inf gradient norm: the batches are consumed, versions 1 and 2 are announced with
    the initial weights bit for bit, and the metrics count the skipped steps."""
    monkeypatch.setattr(step_module, "clip_gradients", lambda model, max_norm: math.inf)
    overrides = ["name=guard", f"model.path={demo_model_dir}", "broker.bootstrap=memory", "trainer.steps=2"]
    overrides += [f"runs_dir={tmp_path}", "trainer.batch_groups=1", "data.n_samples=2"]
    config = resolve(load_config(None, overrides))
    transport = MemoryTransport(TopicLayout())
    groups = [
        PromptGroup(
            prompt_id=f"p{n}", row_index=n, epoch=0, release_index=n, released_at_version=0, prompt_text="47+8=",
            prompt_tokens=[7, 10, 13], answer="55", n_samples=2,
        )
        for n in range(2)
    ]  # fmt: skip
    async with transport.outbox() as outbox:
        for group in groups:
            await outbox.send_now("prompts", group, key=group.prompt_id)
            for sample in (0, 1):
                await outbox.send_now("scored", scored(group, sample, float(sample)), key=group.prompt_id)
    await asyncio.wait_for(trainer_worker.main(config, asyncio.Event(), transport), 60)

    assert [m.step for m in transport.broker.messages("batches", BatchManifest)] == [1, 2]
    announced = transport.broker.messages("weights", WeightVersion)
    assert [a.version for a in announced] == [0, 1, 2] and announced[-1].final
    initial, *later = [load_file(a.uri) for a in announced]
    assert all(unchanged(initial, version) for version in later)  # published, with the weights never changed
    lines = [json.loads(line) for line in (runtime.run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["skipped_updates"], line["skipped_steps"]) for line in lines] == [(1, 1, 1), (2, 1, 2)]
