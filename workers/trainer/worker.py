"""The trainer: complete groups from `scored` -> manifest on `batches` -> PPO step -> new weights.

Staleness: a group released at version v is trained by version v + eta; the
trainer follows `prompts` to know which groups are due and waits for a straggler
at its deadline rather than stepping past it (dropping it would bias training
towards short answers).

Exactly once: the manifest of a step is written before the step; a restarted
trainer loads its last checkpoint, re-reads `scored` from where that checkpoint
still had untrained records, skips what the checkpoint and earlier manifests
trained or dropped, and re-executes the manifests written after the checkpoint
with exactly their trajectories before it takes new batches.

Ranks: under torchrun (WORLD_SIZE > 1) every rank holds an FSDP2 shard; rank 0
alone talks to Kafka and tells the others what to do (`Trainer.follow`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link
from transformers import AutoModelForCausalLM

from schemas.config import RunConfig
from schemas.messages import BatchManifest, DroppedGroup, PromptGroup, Scored, WeightVersion
from topics.clients import assigned_consumer, make_producer, send_and_wait
from topics.dead_letter import decode_or_dead_letter
from topics.names import TopicLayout
from topics.readers import read_topic
from topics.tracing import context_of
from workers import runtime
from workers.trainer import checkpoint
from workers.trainer.advantages import ESTIMATORS
from workers.trainer.buffer import Group, GroupBuffer
from workers.trainer.distributed import close_distributed, distributed_train_step, full_state_dict, init_distributed, shard_model
from workers.trainer.microbatch import allocator
from workers.trainer.step import collate, train_step
from workers.weights import unique_state_dict, write_version

Sequences = list[tuple[list[int], list[int], list[float]]]  # (prompt, completion, behaviour logprobs)


class Trainer:
    """Model, optimizer and counters. Rank 0 calls `train`, `publish` and `save`; under torchrun each
    first tells the other ranks (waiting in `follow`) to join, since every one is a collective."""

    def __init__(self, config: RunConfig, restore_from: Path | None):
        """`restore_from`: a checkpoint to start from; None = the initial weights at model.path."""
        self.config, self.cfg = config, config.trainer
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.device = init_distributed() if self.world > 1 else torch.device(config.model.device)
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.model = self._load_model()
        if self.world > 1:
            shard_model(self.model)  # before the optimizer: the parameters become sharded DTensors
        self.reference = self._load_model().eval().requires_grad_(False) if self.cfg.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.state = checkpoint.load(restore_from, self.model, self.optimizer)

    def _load_model(self) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(self.config.model.path, dtype=torch.float32).to(self.device)

    def train(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on these groups (rank 0); returns the step's stats."""
        version = self.state.step
        rewards = torch.tensor([[s.reward for s, _ in g.trajectories()] for g in groups])  # [G, n]
        advantages = ESTIMATORS[self.cfg.advantage](rewards).flatten().tolist()
        trajectories = [s for g in groups for s, _ in g.trajectories()]
        sequences = [(s.prompt_tokens, s.completion_tokens, s.logprobs) for s in trajectories]
        stats = self._command("train_batch", (sequences, advantages))
        lags = [version - s.released_at_version for s in trajectories]
        tokens = sum(len(s.completion_tokens) for s in trajectories)
        st = self.state
        st.step += 1
        st.groups_consumed += len(groups)
        st.trained_tokens += tokens
        st.interrupted_trajectories += sum(s.num_segments > 1 for s in trajectories)
        st.mixed_version_trajectories += sum(len(set(s.versions)) > 1 for s in trajectories)
        st.max_staleness_trained = max(st.max_staleness_trained, *lags)
        histogram = Counter(lags)
        return {
            **stats, "reward_mean": rewards.mean().item(), "tokens": tokens,
            "staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags),
            "staleness_histogram": [histogram[lag] for lag in range(max(lags) + 1)],  # trajectories per staleness
            "token_staleness_mean": sum(version - v for s in trajectories for v in s.versions) / max(tokens, 1),
        }

    def publish(self, final: bool = False) -> tuple[Path, str]:
        """Write the whole, unsharded weights of the current version to shared storage (rank 0 writes)."""
        tensors = self._command("gather_weights")
        return write_version(tensors, runtime.weights_dir(self.config), self.state.step, self.cfg.keep_versions)

    def save(self) -> Path:
        return self._command("save_checkpoint", self.state)

    def follow(self) -> None:
        """Ranks > 0: do what rank 0 says until it says stop."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            command, payload = box[0]
            if command == "stop":
                return
            getattr(self, command)(payload)

    def close(self) -> None:
        if self.world > 1 and self.rank == 0:
            dist.broadcast_object_list([("stop", None)], src=0)
        close_distributed()

    def _command(self, command: str, payload=None):
        if self.world > 1:
            dist.broadcast_object_list([(command, payload)], src=0)
        return getattr(self, command)(payload)

    def train_batch(self, batch: tuple[Sequences, list[float]]) -> dict[str, float]:
        sequences, advantages = batch
        cfg = self.cfg
        return (distributed_train_step if self.world > 1 else train_step)(
            self.model, self.optimizer, collate(sequences, advantages, pad_id=0, device=self.device),
            decoupled=cfg.objective == "decoupled", minibatches=cfg.minibatches,
            grad_clip=cfg.grad_clip, temperature=self.config.rollout.temperature,
            split=allocator(cfg.microbatch, cfg.max_tokens_per_microbatch, cfg.min_microbatches, cfg.microbatches_fixed),
            clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, behaviour_weight_cap=cfg.behaviour_weight_cap,
            behaviour_weight_mode=cfg.behaviour_weight_mode, behaviour_weight_level=cfg.behaviour_weight_level,
            aggregation=cfg.loss_aggregation, max_new_tokens=self.config.rollout.max_new_tokens,
            kl_coef=cfg.kl_coef, reference=self.reference,
        )

    def gather_weights(self, _=None) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model) if self.world > 1 else unique_state_dict(self.model)

    def save_checkpoint(self, state: checkpoint.TrainerState) -> Path:
        return checkpoint.save(checkpoints_dir(self.config), state, self.model, self.optimizer, self.cfg.keep_checkpoints)


def checkpoints_dir(config: RunConfig) -> Path:
    return runtime.run_dir(config) / "checkpoints"


def restore(manifests: list[BatchManifest], state: checkpoint.TrainerState) -> tuple[list[BatchManifest], GroupBuffer]:
    """After a (re)start from `state`: the manifests to re-execute, and a buffer that skips what is done."""
    redo = [m for m in manifests if m.step > state.step]  # written, but the step was lost with the process
    trained = {t for m in manifests if m.step <= state.step for t in m.trajectory_ids}
    dropped = {d.prompt_id for m in manifests for d in m.dropped}
    done = set(state.done_prompts) | {t.rsplit("/", 1)[0] for t in trained} | dropped
    return redo, GroupBuffer(trained, done)


def new_manifest(groups: list[Group], version: int, resume: dict[int, int], dropped: list[DroppedGroup]) -> BatchManifest:
    """The record of the step about to be taken from `version`, written before it."""
    return BatchManifest(
        step=version + 1, trainer_version=version,
        trajectory_ids=[s.trajectory_id for g in groups for s, _ in g.trajectories()],
        scored_offsets=[where for g in groups for _, where in g.trajectories()],
        consumed_offsets=sorted(resume.items()), dropped=dropped,
    )


class Feed:
    """Reads `prompts` (deadlines) and `scored` (trajectories) into the buffer; remembers where it is."""

    def __init__(self, buffer: GroupBuffer, producer: AIOKafkaProducer, layout: TopicLayout, me: str,
                 releases: AIOKafkaConsumer, scored: AIOKafkaConsumer, positions: dict[int, int]):
        self.buffer, self.producer, self.layout, self.me = buffer, producer, layout, me
        self.releases, self.scored = releases, scored
        self.positions = dict(positions)  # `scored` partition -> next offset to read
        self.traces: dict[str, Context] = {}  # prompt id -> the trace its scored records carried

    async def poll(self) -> None:
        for records in (await self.releases.getmany(timeout_ms=0)).values():
            for record in records:
                group = await self._decode(record, PromptGroup)
                if group is not None:
                    self.buffer.note_release(group.prompt_id, group.released_at_version)
        for tp, records in (await self.scored.getmany(timeout_ms=100)).items():
            for record in records:
                self.positions[tp.partition] = record.offset + 1
                scored = await self._decode(record, Scored)
                if scored is not None and self.buffer.add(scored, (tp.partition, record.offset)):
                    self.traces.setdefault(scored.prompt_id, context_of(record))

    def resume_offsets(self) -> dict[int, int]:
        """Where a restart must read `scored` from: past what was read, except what is still buffered."""
        return {**self.positions, **self.buffer.oldest_positions()}

    async def _decode(self, record, cls):
        return await decode_or_dead_letter(record, cls, self.producer, dead_letter_topic=self.layout.name("dead-letter"), origin=self.me)


async def main(config: RunConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(config.trainer.threads)
    torch.manual_seed(config.seed)
    trainer = Trainer(config, checkpoint.newest(checkpoints_dir(config)))
    try:
        if trainer.rank == 0:
            await lead(config, trainer, stop)
        else:
            await asyncio.to_thread(trainer.follow)
    finally:
        trainer.close()


async def lead(config: RunConfig, trainer: Trainer, stop: asyncio.Event) -> None:
    """Rank 0's loop: read, take a batch (or redo a recorded one), write its manifest, train, publish."""
    me = runtime.worker_id("trainer")
    log = runtime.configure_logging(runtime.run_dir(config) / "logs" / f"{me}.jsonl")
    runtime.configure_tracing(config, "trainer")
    tracer = trace.get_tracer(__name__)
    metrics = runtime.MetricsWriter(runtime.run_dir(config) / "metrics.jsonl", "trainer")
    layout, bootstrap = runtime.topic_layout(config), runtime.bootstrap(config)
    st, cfg = trainer.state, config.trainer
    manifests = [r.message for r in await read_topic(bootstrap, layout.name("batches"), BatchManifest) if isinstance(r.message, BatchManifest)]
    redo, buffer = restore(manifests, st)
    fetch = runtime.consumer_settings(config)
    log.info("trainer started", step=st.step, ranks=trainer.world, redo=[m.step for m in redo], resume_offsets=st.resume_offsets)

    async with (
        make_producer(bootstrap) as producer,
        assigned_consumer(bootstrap, layout.name("scored"), st.resume_offsets, **fetch) as scored,
        assigned_consumer(bootstrap, layout.name("prompts"), **fetch) as releases,  # deadlines of groups still generating
    ):
        feed = Feed(buffer, producer, layout, me, releases, scored, st.resume_offsets)
        pending_drops: list[DroppedGroup] = []  # dropped since the last manifest, recorded in the next one

        async def announce(final: bool = False) -> None:
            path, digest = await asyncio.to_thread(trainer.publish)
            await send_and_wait(producer, layout.name("weights"), WeightVersion(
                version=st.step, uri=str(path.resolve()), content_hash=digest, step=st.step,
                groups_consumed=st.groups_consumed, groups_dropped=st.groups_dropped, final=final))

        def save_checkpoint() -> None:
            st.resume_offsets = feed.resume_offsets()  # re-read whatever is not trained yet
            st.done_prompts = sorted(buffer.done_prompts - {d.prompt_id for d in pending_drops})  # unrecorded drops redo
            trainer.save()

        await announce()
        started = time.monotonic()
        while st.step < cfg.steps and not stop.is_set():
            await feed.poll()
            if redo:
                groups, dropped = buffer.take_exact(redo[0].trajectory_ids), []
                manifest = redo.pop(0) if groups else None
            else:
                (groups, dropped), manifest = buffer.take(cfg.batch_groups, st.step, cfg.max_staleness), None
            if dropped:
                for group in dropped:
                    feed.traces.pop(group.prompt_id, None)
                st.groups_dropped += len(dropped)
                pending_drops += dropped
                log.warning("groups dropped", groups=[d.prompt_id for d in dropped], reason=dropped[0].reason)
                await announce()  # the prompt source may release in their place
            if not groups:
                continue
            if manifest is None:
                manifest = new_manifest(groups, st.step, feed.resume_offsets(), pending_drops)
                await send_and_wait(producer, layout.name("batches"), manifest, key=manifest.step)
                pending_drops = []
            step_started = time.monotonic()
            with tracer.start_as_current_span("train step", attributes={"asyncrl.step": st.step + 1}) as step_span:
                group_spans = [  # one per group, in its prompt's trace, linked to the step
                    tracer.start_span("train group", context=feed.traces.pop(g.prompt_id), links=[Link(step_span.get_span_context())],
                                      attributes={"asyncrl.prompt_id": g.prompt_id, "asyncrl.step": st.step + 1})
                    for g in groups if g.prompt_id in feed.traces
                ]
                stats = await asyncio.to_thread(trainer.train, groups)
                for span in group_spans:
                    span.end()
            await announce(final=st.step >= cfg.steps)
            elapsed = time.monotonic() - started
            metrics.write(
                step=st.step, **stats, step_seconds=time.monotonic() - step_started, elapsed=elapsed,
                tokens_per_s=st.trained_tokens / elapsed, trained_tokens=st.trained_tokens,
                groups_consumed=st.groups_consumed, groups_dropped=st.groups_dropped,
                interrupted_trajectories=st.interrupted_trajectories,
                mixed_version_trajectories=st.mixed_version_trajectories, max_staleness_trained=st.max_staleness_trained,
            )
            if st.step % cfg.checkpoint_every == 0 or st.step >= cfg.steps:
                await asyncio.to_thread(save_checkpoint)
        if stop.is_set() and st.step % cfg.checkpoint_every:
            await asyncio.to_thread(save_checkpoint)
        log.info("trainer finished", step=st.step, stopped=stop.is_set())
