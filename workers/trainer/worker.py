"""The trainer: complete groups from `scored` -> manifest on `batches` -> PPO step -> new weights.

Staleness: a group released at version v is trained by version v + eta; the
trainer follows `prompts` to know which groups are due and waits for a straggler
at its deadline rather than stepping past it (dropping it would bias training
towards short answers).

Exactly once: the manifest of a step is sent before the step and delivered before its
version is announced (weights are written and announced in the background while the
next step trains, `Lead.announce`); a restarted
trainer loads its last checkpoint, re-reads `scored` from where that checkpoint
still had untrained records, skips what the checkpoint and earlier manifests
trained or dropped, and re-executes the manifests written after the checkpoint
with exactly their trajectories before it takes new batches. On the embedded broker,
which keeps topics in memory only, the topics are appended to the run's export before
each checkpoint (`Lead.checkpoint`), so `asyncrl run --resume` finds, in a new broker,
everything a checkpoint names; the weights files of versions it does not name (a killed run got past
its last export) are deleted before the first announcement: the steps trained anew write other weights.

A non-finite update (NaN or inf loss or gradient norm) is skipped, not applied
(`step.apply_update`), yet the step happens as any other: its manifest stands, its
groups are consumed (never trained again: they would fail the same way), the version
advances and the unchanged weights are published and announced. So versions stay
contiguous (manifest step == version), exactly once holds, the prompt source's bound
moves on, and a restart redoing that manifest skips it alike. `skipped_steps` counts them.

Ranks: under torchrun (WORLD_SIZE > 1) every rank holds an FSDP2 shard; rank 0
alone talks to Kafka and tells the others what to do (`model.Trainer`, `ranks.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import torch
from opentelemetry.context import Context
from opentelemetry.trace import Link

from schemas.config import RunConfig
from schemas.messages import BatchManifest, DroppedGroup, PromptGroup, Scored, WeightVersion, prompt_id_of
from topics.export import ExportError, append_export
from topics.transport import Delivery, Inbox, Outbox, Transport
from workers import runtime
from workers.announce import load_key, signed_headers
from workers.profiling import step_profiler
from workers.trainer import checkpoint
from workers.trainer.buffer import UNIFORM, Group, GroupBuffer
from workers.trainer.model import Trainer, checkpoints_dir
from workers.trainer.step import PhaseClock
from workers.vocab import outside_vocab
from workers.weight_deltas import Published
from workers.weights import drop_versions_after


def restore(
    manifests: list[BatchManifest], state: checkpoint.TrainerState
) -> tuple[list[BatchManifest], GroupBuffer, list[DroppedGroup]]:
    """After a (re)start from `state`: the manifests to re-execute, a buffer that skips what is done, and the
    groups the checkpoint had dropped that no manifest records yet (the next new manifest must)."""
    # written, but the step was lost with the process; in step order (`batches` is read partition by partition)
    redo = sorted((m for m in manifests if m.step > state.step), key=lambda m: m.step)
    trained = {t for m in manifests if m.step <= state.step for t in m.trajectory_ids}
    dropped = {d.prompt_id for m in manifests for d in m.dropped}
    done = set(state.done_prompts) | {prompt_id_of(t) for t in trained} | dropped
    pending = [DroppedGroup(prompt_id=pid, reason=reason) for pid, reason in state.pending_drops if pid not in dropped]
    return redo, GroupBuffer(trained, done), pending


def is_skip(drop: DroppedGroup) -> bool:
    """Dropped for having no advantage (skip_uniform_groups), not for a passed deadline."""
    return drop.reason.startswith(UNIFORM)


def new_manifest(
    groups: list[Group], version: int, resume: dict[int, int], dropped: list[DroppedGroup]
) -> BatchManifest:
    """The record of the step about to be taken from `version`, written before it."""
    uniform = [g.prompt_id for g in groups if g.uniform_reward() is not None]
    return BatchManifest(
        step=version + 1,
        trainer_version=version,
        trajectory_ids=[s.trajectory_id for g in groups for s, _ in g.trajectories()],
        scored_offsets=[where for g in groups for _, where in g.trajectories()],
        consumed_offsets=sorted(resume.items()),
        dropped=dropped,
        uniform=uniform + [d.prompt_id for d in dropped if is_skip(d)],
    )


class Feed:
    """Reads `prompts` (deadlines) and `scored` (trajectories) into the buffer; what the model cannot train
    goes to `dead-letter`, never into a batch."""

    def __init__(self, buffer: GroupBuffer, releases: Inbox[PromptGroup], scored: Inbox[Scored], vocab: int):
        self.buffer, self.releases, self.scored, self.vocab = buffer, releases, scored, vocab
        self.traces: dict[str, Context] = {}  # prompt id -> the trace its scored records carried

    async def poll(self, wait_s: float) -> None:
        """What has arrived; `wait_s`: how long to wait for a trajectory when none has (0 while a batch is ready:
        waiting for the next record would stall the step it could start now)."""
        for delivery in await self.releases.poll(0):
            await self.release(delivery)
        for delivery in await self.scored.poll(wait_s):
            await self.take_in(delivery)

    async def release(self, delivery: Delivery[PromptGroup]) -> None:
        """Note a group's deadline and size. A release outside the model (the rollout dead-letters it too) or
        contradicting one already read is forged: it goes to `dead-letter` and changes nothing, so no
        deadline waits for it and it never counts as a dropped group."""
        group = delivery.message
        problem = outside_vocab(self.vocab, prompt_tokens=group.prompt_tokens)
        if problem or (problem := self.buffer.note_release(group)):
            await self.releases.reject(delivery, problem)

    async def take_in(self, delivery: Delivery[Scored]) -> None:
        """Buffer one trajectory; one outside the model or at odds with its group is rejected alone."""
        scored = delivery.message
        tokens = {"prompt_tokens": scored.prompt_tokens, "completion_tokens": scored.completion_tokens}
        if problem := outside_vocab(self.vocab, **tokens) or self.buffer.disagreement(scored):
            await self.scored.reject(delivery, problem)
        elif self.buffer.add(scored, (delivery.partition, delivery.offset)):
            self.traces.setdefault(scored.prompt_id, delivery.trace())

    def resume_offsets(self) -> dict[int, int]:
        """Where a restart must read `scored` from: past what was read, except what is still buffered."""
        return {**self.scored.positions, **self.buffer.oldest_positions()}


class Lead:
    """Rank 0's side of each step: which batch, its manifest, the step, weights out, checkpoints, metrics."""

    def __init__(
        self,
        ctx: runtime.WorkerContext,
        trainer: Trainer,
        outbox: Outbox,
        feed: Feed,
        redo: list[BatchManifest],
        pending_drops: list[DroppedGroup],
    ):
        self.ctx, self.trainer, self.outbox, self.feed, self.redo = ctx, trainer, outbox, feed, redo
        self.state, self.cfg = trainer.state, ctx.config.trainer
        self.pending_drops = pending_drops  # dropped since the last manifest; the next records and counts them
        self.metrics, self.started = ctx.metrics(), time.monotonic()
        self.step_ended = time.perf_counter()  # the wait for the next batch starts here
        self.held_since: float | None = None  # since when a due group's straggler holds a ready batch back
        self.held_seconds = 0.0  # of the wait for the next batch, how long such a straggler held it back
        self.publishing: asyncio.Task | None = None  # the newest version's write and announcement, off the step's path
        self.publish_lag = 0.0  # seconds from a version's snapshot to its announcement, the last one delivered
        self.write_seconds = 0.0  # seconds the last version's file took to write and hash (off the step's path)
        self.copied: int | None = None  # the newest version whose weights were copied for writing
        self.written: Published | None = None  # its file, whole hash and base, once written
        self.key = load_key(ctx.run_dir)  # signs every announcement (workers.announce); None: the run has no key

    async def next_batch(self) -> tuple[list[Group], BatchManifest | None]:
        """A recorded step to redo once its groups are all here, else a new batch (empty while not ready)."""
        buffer = self.feed.buffer
        if self.redo:
            groups = buffer.take_exact(self.redo[0].trajectory_ids)
            return (groups, self.redo.pop(0)) if groups else ([], None)
        groups, dropped = buffer.take(
            self.cfg.batch_groups, self.state.step, self.cfg.max_staleness, self.cfg.skip_uniform_groups
        )
        self.note_straggler(
            not groups and buffer.held_by_straggler(self.cfg.batch_groups, self.state.step, self.cfg.max_staleness)
        )
        if dropped:
            for group in dropped:
                self.feed.traces.pop(group.prompt_id, None)
            self.pending_drops += dropped
            if stale := [d for d in dropped if not is_skip(d)]:  # uniform ones: by design
                self.ctx.log.warning("groups dropped", groups=[d.prompt_id for d in stale], reason=stale[0].reason)
            await self.announce()  # the prompt source may release in their place
        return groups, None

    def note_straggler(self, held: bool) -> None:
        """Count the time a due group's straggler holds a ready batch back (`time_wait_due`, part of `time_wait`)."""
        now = time.perf_counter()
        if self.held_since is not None:
            self.held_seconds += now - self.held_since
        self.held_since = now if held else None

    async def step(self, groups: list[Group], manifest: BatchManifest | None) -> None:
        """Write the manifest (a new batch's) before the step, train, announce the new version. Each phase's
        seconds go to the step's metrics (`time_*`), with the wait for the batch before it."""
        clock = PhaseClock()
        clock.seconds["time_wait"] = clock.last - self.step_ended
        clock.seconds["time_wait_due"], self.held_seconds = self.held_seconds, 0.0
        recorded = None  # a new batch's manifest is delivered while the step trains, and before its version is out
        if manifest is None:
            manifest = new_manifest(groups, self.state.step, self.feed.resume_offsets(), self.pending_drops)
            recorded = await self.outbox.send("batches", manifest, key=manifest.step)
            self.pending_drops = []
        self.state.groups_dropped += len(manifest.dropped)  # a redone manifest's drops too: the count is the manifests'
        self.state.groups_skipped += sum(map(is_skip, manifest.dropped))
        clock.lap("time_manifest")
        step_started, tracer = time.monotonic(), self.ctx.tracer
        with tracer.start_as_current_span("train step", attributes={"asyncrl.step": manifest.step}) as step_span:
            group_spans = [  # one per group, in its prompt's trace, linked to the step
                tracer.start_span(
                    "train group",
                    context=self.feed.traces.pop(g.prompt_id),
                    links=[Link(step_span.get_span_context())],
                    attributes={"asyncrl.prompt_id": g.prompt_id, "asyncrl.step": manifest.step},
                )
                for g in groups
                if g.prompt_id in self.feed.traces
            ]
            stats = {**await asyncio.to_thread(self.trainer.train, groups), "threads": self.cfg.threads}
            runtime.release_freed_memory()  # the step's activations, freed in the thread's own arena
            for span in group_spans:
                span.end()
        clock.lap("time_train")
        if stats["skipped_updates"]:  # the batch is consumed and the version advances with unchanged weights
            self.ctx.log.warning("update skipped, weights unchanged", step=manifest.step, reason=stats["skip_reason"])
        await self.announce(final=self.state.step >= self.cfg.steps, clock=clock, after=recorded)
        if self.state.step % self.cfg.checkpoint.every == 0 or self.state.step >= self.cfg.steps:
            await self.checkpoint()
        clock.lap("time_checkpoint")
        self.step_ended = clock.last
        self.report(
            {**stats, **clock.seconds, "publish_lag": self.publish_lag, "write_seconds": self.write_seconds},
            time.monotonic() - step_started,
        )

    async def announce(self, final: bool = False, clock: PhaseClock | None = None, after: Awaitable | None = None):
        """Publish the current weights and tell `weights` (path and sha256, signed with the run's key).

        Only the copy of the weights is on the step's path (`time_publish`); writing, hashing and the
        announcement run while the next step trains, each after the previous version's announcement and
        `after` (the step's manifest: a version is never out before the record of what it trained). The
        final version's announcement is awaited."""
        st, clock = self.state, clock or PhaseClock()
        if self.publishing is not None and self.publishing.done():
            self.publishing.result()  # a publication that failed stops the run now, not at the next checkpoint
        fresh = st.step != self.copied  # else only the counts changed (groups dropped): the file is announced again
        weights = await asyncio.to_thread(self.trainer.snapshot) if fresh else None
        self.copied = st.step
        clock.lap("time_publish")
        version = {"version": st.step, "step": st.step, "final": final}
        dropped = st.groups_dropped + len(self.pending_drops)  # the source releases in their place at once
        counts = {
            "groups_consumed": st.groups_consumed,
            "groups_dropped": dropped,
            "groups_skipped": st.groups_skipped + sum(map(is_skip, self.pending_drops)),
        }
        previous, snapped = self.publishing, time.perf_counter()
        self.publishing = asyncio.create_task(self.publish(weights, version | counts, [previous, after], snapped))
        if final:
            await self.published()

    async def publish(self, weights: dict | None, fields: dict, before: list, snapped: float) -> None:
        for awaited in filter(None, before):
            await awaited
        if weights is not None:
            started = time.perf_counter()
            self.written = await asyncio.to_thread(self.trainer.publish, weights, fields["version"])
            self.write_seconds = time.perf_counter() - started
        written = self.written
        announcement = WeightVersion(
            uri=str(written.path.resolve()), content_hash=written.sha256, base_version=written.base_version, **fields
        )
        await self.outbox.send_now("weights", announcement, headers=signed_headers(self.key, announcement))
        self.publish_lag = time.perf_counter() - snapped

    async def published(self) -> None:
        """Wait until the newest version is announced (raising what its publication raised)."""
        if self.publishing is not None:
            await self.publishing

    async def checkpoint(self) -> None:
        """Save where a restart resumes. On the embedded broker, which loses its topics when it dies, first
        append them to the run's export: a checkpoint is then never newer than the topics it names (the
        manifests, the `scored` offsets, the weights announcements); one whose export fails is skipped."""
        st, config = self.state, self.ctx.config
        await self.published()  # the export below then holds the announcement of the version saved
        if config.launcher.embedded_broker:
            try:
                prefix = config.broker.topic_prefix
                await append_export(config.broker.bootstrap, runtime.topics_export_path(config), prefix)
            except ExportError as exc:
                self.ctx.log.warning("checkpoint skipped: topics not exported", step=st.step, error=str(exc))
                return
        st.resume_offsets = self.feed.resume_offsets()  # re-read whatever is not trained yet
        st.done_prompts = sorted(self.feed.buffer.done_prompts)
        st.pending_drops = [(d.prompt_id, d.reason) for d in self.pending_drops]  # their records are not re-read
        await asyncio.to_thread(self.trainer.save)

    def report(self, stats: dict, step_seconds: float) -> None:
        st, elapsed = self.state, time.monotonic() - self.started
        self.metrics.write(
            step=st.step,
            **stats,
            step_seconds=step_seconds,
            elapsed=elapsed,
            tokens_per_s=st.trained_tokens / elapsed,
            trained_tokens=st.trained_tokens,
            trained_trajectories=st.trained_trajectories,
            groups_consumed=st.groups_consumed,
            groups_dropped=st.groups_dropped,
            groups_skipped=st.groups_skipped,
            interrupted_trajectories=st.interrupted_trajectories,
            truncated_trajectories=st.truncated_trajectories,
            mixed_version_trajectories=st.mixed_version_trajectories,
            max_staleness_trained=st.max_staleness_trained,
            skipped_steps=st.skipped_steps,
        )


async def main(config: RunConfig, stop: asyncio.Event, transport: Transport | None = None) -> None:
    torch.set_num_threads(config.trainer.threads)
    torch.manual_seed(config.seed)
    trainer = Trainer(config, checkpoint.newest(checkpoints_dir(config)))
    try:
        if trainer.rank == 0:
            await lead(runtime.WorkerContext.start(config, "trainer", transport), trainer, stop)
        else:
            await asyncio.to_thread(trainer.follow)
    finally:
        trainer.close()


async def resume(
    ctx: runtime.WorkerContext, trainer: Trainer
) -> tuple[list[BatchManifest], GroupBuffer, list[DroppedGroup]]:
    """Where the trainer's checkpoint and `batches` leave it (`restore`), the weights files of versions past
    them deleted."""
    st = trainer.state
    manifests = [
        r.message
        for r in await ctx.transport.read_all("batches", BatchManifest)
        if isinstance(r.message, BatchManifest)
    ]
    redo, buffer, pending_drops = restore(manifests, st)
    recorded = max([st.step, *(m.step for m in redo)])  # a newer version's file is of a timeline left behind
    abandoned = []  # a fresh trainer's: none, and whatever its weights directory holds is not its own
    if recorded:
        abandoned = await asyncio.to_thread(drop_versions_after, runtime.weights_dir(ctx.config), recorded)
    ctx.log.info(
        "trainer started",
        step=st.step,
        ranks=trainer.world,
        nodes=trainer.nodes,
        redo=[m.step for m in redo],
        resume_offsets=st.resume_offsets,
        abandoned_versions_deleted=abandoned,
    )
    return redo, buffer, pending_drops


async def lead(ctx: runtime.WorkerContext, trainer: Trainer, stop: asyncio.Event) -> None:
    """Rank 0's loop: read, take a batch (or redo a recorded one), write its manifest, train, publish."""
    st, cfg = trainer.state, ctx.config.trainer
    redo, buffer, pending_drops = await resume(ctx, trainer)
    async with (
        ctx.transport.outbox() as outbox,
        ctx.transport.inbox("scored", Scored, outbox, origin=ctx.id, start_offsets=st.resume_offsets) as scored,
        ctx.transport.inbox("prompts", PromptGroup, outbox, origin=ctx.id) as releases,  # deadlines of groups
    ):
        loop = Lead(ctx, trainer, outbox, Feed(buffer, releases, scored, trainer.vocab), redo, pending_drops)
        profiler = step_profiler(ctx)
        try:
            await loop.announce()
            groups: list[Group] = []
            while st.step < cfg.steps and not stop.is_set():
                await loop.feed.poll(wait_s=0.0 if groups else 0.1)  # after a step, the next batch may be here
                groups, manifest = await loop.next_batch()
                if groups:
                    await loop.step(groups, manifest)
                    profiler.step()
            await loop.published()
        finally:
            profiler.close()
            if loop.publishing is not None and not loop.publishing.done():  # the step failed: no version after it
                loop.publishing.cancel()
        if stop.is_set() and st.step % cfg.checkpoint.every:
            await loop.checkpoint()
    ctx.log.info("trainer finished", step=st.step, stopped=stop.is_set())
