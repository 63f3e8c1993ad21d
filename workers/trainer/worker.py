"""The trainer: complete groups from `scored` -> manifest on `batches` -> PPO step -> new weights.

Staleness: a group released at version v is trained by version v + eta; the
trainer follows `prompts` to know which groups are due and waits for a straggler
at its deadline rather than stepping past it (dropping it would bias training
towards short answers).

Exactly once: the manifest of a step is written before the step; a restarted
trainer loads its last checkpoint, re-reads `scored` from where that checkpoint
still had untrained records, skips what earlier manifests trained or dropped,
and re-executes the manifests written after the checkpoint with exactly their
trajectories before it takes new batches.
"""

from __future__ import annotations

import asyncio
import time

import torch
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link
from transformers import AutoModelForCausalLM

from schemas.config import RunConfig
from schemas.messages import BatchManifest, DroppedGroup, PromptGroup, Scored, WeightVersion
from topics.clients import assigned_consumer, make_producer, send_and_wait
from topics.dead_letter import decode_or_dead_letter
from topics.readers import read_topic
from topics.tracing import context_of
from workers import runtime
from workers.trainer import checkpoint
from workers.trainer.advantages import ESTIMATORS
from workers.trainer.buffer import Group, GroupBuffer
from workers.trainer.microbatch import allocator
from workers.trainer.step import collate, train_step
from workers.weights import write_version


class Trainer:
    """Holds the model and the counters; `train` runs one step on a list of groups."""

    def __init__(self, config: RunConfig):
        self.config, self.cfg = config, config.trainer
        self.device = torch.device(config.model.device)
        self.model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.checkpoints = runtime.run_dir(config) / "checkpoints"
        self.state = checkpoint.load_latest(self.checkpoints, self.model, self.optimizer)

    def train(self, groups: list[Group]) -> dict[str, float]:
        version = self.state.step
        rewards = torch.tensor([[s.reward for s, _ in g.trajectories()] for g in groups])  # [G, n]
        advantages = ESTIMATORS[self.cfg.advantage](rewards).flatten().tolist()
        trajectories = [s for g in groups for s, _ in g.trajectories()]
        batch = collate([(s.prompt_tokens, s.completion_tokens, s.logprobs) for s in trajectories], advantages, pad_id=0, device=self.device)
        cfg = self.cfg
        stats = train_step(
            self.model, self.optimizer, batch,
            decoupled=cfg.objective == "decoupled", minibatches=cfg.minibatches,
            grad_clip=cfg.grad_clip, temperature=self.config.rollout.temperature,
            split=allocator(cfg.microbatch, cfg.max_tokens_per_microbatch, cfg.min_microbatches, cfg.microbatches_fixed),
            clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, behaviour_weight_cap=cfg.behaviour_weight_cap,
            behaviour_weight_mode=cfg.behaviour_weight_mode, behaviour_weight_level=cfg.behaviour_weight_level,
            aggregation=cfg.loss_aggregation, max_new_tokens=self.config.rollout.max_new_tokens,
        )
        lags = [version - s.released_at_version for s in trajectories]
        tokens = sum(len(s.completion_tokens) for s in trajectories)
        st = self.state
        st.step += 1
        st.groups_consumed += len(groups)
        st.trained_tokens += tokens
        st.interrupted_trajectories += sum(s.num_segments > 1 for s in trajectories)
        st.mixed_version_trajectories += sum(len(set(s.versions)) > 1 for s in trajectories)
        st.max_staleness_trained = max(st.max_staleness_trained, *lags)
        return {
            **stats, "reward_mean": rewards.mean().item(), "tokens": tokens,
            "staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags),
            "token_staleness_mean": sum(version - v for s in trajectories for v in s.versions) / max(tokens, 1),
        }


def restore(manifests: list[BatchManifest], step: int) -> tuple[list[BatchManifest], GroupBuffer]:
    """After a (re)start at `step`: the manifests to re-execute, and a buffer that skips what is done."""
    redo = [m for m in manifests if m.step > step]  # written, but the step was lost with the process
    trained = {t for m in manifests if m.step <= step for t in m.trajectory_ids}
    dropped = {d.prompt_id for m in manifests for d in m.dropped}
    return redo, GroupBuffer(trained, {t.rsplit("/", 1)[0] for t in trained} | dropped)


def new_manifest(groups: list[Group], version: int, resume: dict[int, int], dropped: list[DroppedGroup]) -> BatchManifest:
    """The record of the step about to be taken from `version`, written before it."""
    return BatchManifest(
        step=version + 1, trainer_version=version,
        trajectory_ids=[s.trajectory_id for g in groups for s, _ in g.trajectories()],
        scored_offsets=[where for g in groups for _, where in g.trajectories()],
        consumed_offsets=sorted(resume.items()), dropped=dropped,
    )


async def main(config: RunConfig, stop: asyncio.Event) -> None:
    me = runtime.worker_id("trainer")
    log = runtime.configure_logging(runtime.run_dir(config) / "logs" / f"{me}.jsonl")
    torch.set_num_threads(config.trainer.threads)
    torch.manual_seed(config.seed)
    runtime.configure_tracing(config, "trainer")
    tracer = trace.get_tracer(__name__)
    metrics = runtime.MetricsWriter(runtime.run_dir(config) / "metrics.jsonl", "trainer")
    layout, bootstrap = runtime.topic_layout(config), runtime.bootstrap(config)
    trainer = Trainer(config)
    st, cfg = trainer.state, config.trainer
    manifests = [r.message for r in await read_topic(bootstrap, layout.name("batches"), BatchManifest) if isinstance(r.message, BatchManifest)]
    redo, buffer = restore(manifests, st.step)
    log.info("trainer started", step=st.step, redo=[m.step for m in redo], resume_offsets=st.resume_offsets)

    async with (
        make_producer(bootstrap) as producer,
        assigned_consumer(bootstrap, layout.name("scored"), st.resume_offsets) as consumer,
        assigned_consumer(bootstrap, layout.name("prompts")) as releases,  # deadlines of groups still generating
    ):
        async def announce(final: bool = False) -> None:
            path, digest = write_version(trainer.model, runtime.weights_dir(config), st.step, cfg.keep_versions)
            await send_and_wait(producer, layout.name("weights"), WeightVersion(
                version=st.step, uri=str(path.resolve()), content_hash=digest, step=st.step,
                groups_consumed=st.groups_consumed, groups_dropped=st.groups_dropped, final=final))

        def save_checkpoint() -> None:
            st.resume_offsets = {**positions, **buffer.oldest_positions()}  # re-read whatever is not trained yet
            checkpoint.save(trainer.checkpoints, st, trainer.model, trainer.optimizer)

        await announce()
        positions: dict[int, int] = dict(st.resume_offsets)
        traces: dict[str, Context] = {}  # prompt id -> the trace its scored records carried
        pending_drops: list[DroppedGroup] = []
        started = time.monotonic()
        while st.step < cfg.steps and not stop.is_set():
            for records in (await releases.getmany(timeout_ms=0)).values():
                for record in records:
                    group = await decode_or_dead_letter(record, PromptGroup, producer, dead_letter_topic=layout.name("dead-letter"), origin=me)
                    if group is not None:
                        buffer.note_release(group.prompt_id, group.released_at_version)
            for tp, records in (await consumer.getmany(timeout_ms=100)).items():
                for record in records:
                    positions[tp.partition] = record.offset + 1
                    scored = await decode_or_dead_letter(record, Scored, producer, dead_letter_topic=layout.name("dead-letter"), origin=me)
                    if scored is not None and buffer.add(scored, (tp.partition, record.offset)):
                        traces.setdefault(scored.prompt_id, context_of(record))
            if redo:
                groups = buffer.take_exact(redo[0].trajectory_ids)
                manifest, dropped = (redo.pop(0), []) if groups else (None, [])
            else:
                groups, dropped = buffer.take(cfg.batch_groups, st.step, cfg.max_staleness)
                manifest = None
            for group in dropped:
                traces.pop(group.prompt_id, None)
            if dropped:
                st.groups_dropped += len(dropped)
                pending_drops += dropped
                log.warning("groups dropped", groups=[d.prompt_id for d in dropped], reason=dropped[0].reason)
                await announce()  # the prompt source may release in their place
            if not groups:
                continue
            if manifest is None:
                manifest = new_manifest(groups, st.step, {**positions, **buffer.oldest_positions()}, pending_drops)
                await send_and_wait(producer, layout.name("batches"), manifest, key=manifest.step)
                pending_drops = []
            step_started = time.monotonic()
            with tracer.start_as_current_span("train step", attributes={"asyncrl.step": st.step + 1}) as step_span:
                group_spans = [  # one per group, in its prompt's trace, linked to the step
                    tracer.start_span("train group", context=traces.pop(g.prompt_id), links=[Link(step_span.get_span_context())],
                                      attributes={"asyncrl.prompt_id": g.prompt_id, "asyncrl.step": st.step + 1})
                    for g in groups if g.prompt_id in traces
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
                save_checkpoint()
        if stop.is_set() and st.step % cfg.checkpoint_every:
            save_checkpoint()
        log.info("trainer finished", step=st.step, stopped=stop.is_set())
