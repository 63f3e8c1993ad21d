"""The rollout worker: prompt groups -> version-tagged segments, never waiting for training.

Between two decode steps it looks at `weights`: on a newer version it emits what
every in-flight sequence generated since its last segment (finish reason
`interrupted`), loads the new weights in place and lets the engine recompute the
KV cache of every unfinished prefix. With `rollout.interrupt=false` it instead
stops admitting, lets in-flight sequences finish on the old weights, then loads.
A prompt's offset is committed only once all of its trajectories are emitted.
`rollout.backend` picks the engine: the embedded torch one, or vLLM (same interface).
With `rollout.workflow` a turn ending with a call is answered (`workers/rollout/workflow.py`) while the
engine goes on with the others, and the trajectory continues from the reply in a new turn.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from opentelemetry.context import Context
from safetensors import SafetensorError
from transformers import AutoTokenizer

from schemas.config import RunConfig
from schemas.messages import DeadLetter, PromptGroup, Segment, WeightVersion, encode, prompt_id_of, trajectory_id
from topics.names import ROLLOUT_GROUP
from topics.tracing import trace_headers
from topics.transport import Delivery, Inbox, Outbox, Transport, WeightsFollower
from workers import runtime
from workers.announce import AnnouncementCheck, load_key
from workers.models import end_token_ids, generation_config_of, load_causal_lm
from workers.profiling import step_profiler
from workers.rollout.engine import Engine
from workers.rollout.protocol import RolloutEngine, SamplingParams, Sequence
from workers.rollout.workflow import Conversation, call_token_of, is_call, load_workflow
from workers.vocab import outside_vocab
from workers.weight_deltas import ChainReader
from workers.weights import WeightsError, WeightsFile

METRICS_PERIOD_S = 1.0
UNLOADABLE = (WeightsError, OSError, ValueError, RuntimeError, SafetensorError)  # a file refused, not a crash


@dataclass
class InFlight:
    """One prompt group being generated, and the delivery of its record on `prompts`."""

    delivery: Delivery[PromptGroup]
    unfinished: int
    attempts: dict[str, str] = field(default_factory=dict)  # trajectory id -> attempt id
    segments_sent: dict[str, int] = field(default_factory=dict)  # trajectory id -> segments emitted
    tokens_sent: dict[str, int] = field(default_factory=dict)  # trajectory id -> tokens emitted
    last_sent_ns: dict[str, int] = field(default_factory=dict)  # trajectory id -> when its last segment left
    conversations: dict[str, Conversation] = field(default_factory=dict)  # trajectory id -> its finished turns

    @property
    def group(self) -> PromptGroup:
        return self.delivery.message

    @cached_property
    def trace(self) -> Context:
        """The prompt's trace, from its record's headers: every segment's span joins it."""
        return self.delivery.trace()


def make_engine(config: RunConfig) -> RolloutEngine:
    """The configured backend at version 0, in model.dtype: the embedded torch engine, or vLLM; each with the model's
    tokenizer, for stop strings."""
    if config.rollout.backend == "vllm":
        from workers.rollout.vllm_engine import VLLMEngine  # vLLM itself is imported only here

        return VLLMEngine(
            config.model.path,
            max_batch=config.rollout.max_batch,
            version=0,
            seed=config.seed,
            dtype=config.model.dtype,
            lora_rank=config.model.lora.rank,
        )
    model = load_causal_lm(config.model.path, config.model.dtype, config.model.device)
    return Engine(
        model,
        max_batch=config.rollout.max_batch,
        version=0,
        seed=config.seed,
        cache_lag=config.rollout.cache_lag,
        tokenizer=AutoTokenizer.from_pretrained(config.model.path),
        cache_mb=config.rollout.cache_mb,
        chain=ChainReader(retain=config.trainer.checkpoint.whole_every > 1),  # a delta needs only its own file
    )


class Rollout:
    """The engine and the groups in it: submits samples, emits segments, loads verified weights."""

    def __init__(self, ctx: runtime.WorkerContext, outbox: Outbox, engine: RolloutEngine):
        self.ctx, self.outbox, self.engine = ctx, outbox, engine
        cfg = ctx.config.rollout
        self.tokenizer = AutoTokenizer.from_pretrained(ctx.config.model.path)
        self.workflow = load_workflow(cfg.workflow)
        self.call_token = self.workflow and call_token_of(self.tokenizer, self.workflow.call_end)
        stops = [*end_token_ids(self.tokenizer, generation_config_of(ctx.config.model.path)), self.call_token]
        self.params = SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=tuple(t for t in stops if t is not None),
            stop=tuple(cfg.stop),
        )
        self.groups: dict[str, InFlight] = {}  # prompt id -> group
        self.counter = itertools.count()
        self.interrupted = 0  # segments cut by a new version
        self.generated_tokens = 0  # every token emitted, interrupted runs included
        self.load_seconds = 0.0  # spent verifying and loading weight versions, and how many loaded
        self.loads = 0
        self.engine_seconds = 0.0  # spent in the engine's steps, and how many ran
        self.engine_steps = 0
        self.refused_version = -1  # the newest announced version whose file failed verification
        self.answering: set[asyncio.Task] = set()  # calls being answered, out of the engine meanwhile
        self.answered: list[tuple[str, Conversation]] = []  # their next turns, submitted by the next `step`

    def wants(self, announced: WeightVersion | None) -> bool:
        """A version newer than the engine's that has not been refused."""
        return announced is not None and announced.version > max(self.engine.version, self.refused_version)

    async def start(self, flight: InFlight) -> bool:
        """Submit the group's samples; a prompt the engine refuses ends as `error` segments.

        False when nothing is left to generate: the refused prompt, or a redelivered
        group already in flight here.
        """
        if flight.group.prompt_id in self.groups:
            return False
        self.groups[flight.group.prompt_id] = flight
        keys = [trajectory_id(flight.group.prompt_id, sample) for sample in range(flight.group.n_samples)]
        for key in keys:
            flight.attempts[key] = f"{self.ctx.id}:{next(self.counter)}"
            flight.conversations[key] = Conversation(flight.group.prompt_tokens)
        try:  # the engine checks the prompt, so only the first submit can fail
            for key in keys:
                self.engine.submit(key, flight.group.prompt_tokens, self.params)
        except ValueError as exc:
            for key in keys:
                await self.send(flight, key, self.engine.version, [], [], "error", error=str(exc))
            del self.groups[flight.group.prompt_id]
            return False
        started = time.time_ns()
        flight.last_sent_ns.update((key, started) for key in keys)
        return True

    async def emit(self, seq: Sequence | None, finish_reason: str, key: str = "") -> InFlight:
        """Send the trajectory's tokens (finished turns, replies and the turn `seq` under way) since its last
        segment; returns its group."""
        key = seq.key if seq is not None else key
        flight = self.groups[prompt_id_of(key)]
        conversation, start = flight.conversations[key], flight.tokens_sent.get(key, 0)
        tokens, logprobs, versions, mask = conversation.with_turn(seq)
        version = versions[start] if start < len(versions) else self.engine.version
        loss_mask = mask[start:] if 0 in mask[start:] else []
        await self.send(flight, key, version, tokens[start:], logprobs[start:], finish_reason, loss_mask=loss_mask)
        flight.tokens_sent[key] = len(tokens)
        return flight

    async def send(
        self,
        flight: InFlight,
        key: str,
        version: int,
        tokens: list[int],
        logprobs: list[float],
        finish_reason: str,
        error: str = "",
        loss_mask: list[int] | None = None,
    ) -> None:
        """One segment on `segments`, with a span (in the prompt's trace) covering its generation."""
        index, now = flight.segments_sent.get(key, 0), time.time_ns()
        span = self.ctx.tracer.start_span(
            "generate segment",
            context=flight.trace,
            start_time=flight.last_sent_ns.get(key, now),
            attributes={
                "asyncrl.trajectory_id": key,
                "asyncrl.segment_index": index,
                "asyncrl.version": version,
                "asyncrl.tokens": len(tokens),
                "asyncrl.finish_reason": finish_reason,
            },
        )
        span.end(end_time=now)
        await self.outbox.send(
            "segments",
            Segment(
                trajectory_id=key,
                attempt=flight.attempts[key],
                segment_index=index,
                version=version,
                token_ids=tokens,
                logprobs=logprobs,
                finish_reason=finish_reason,
                worker_id=self.ctx.id,
                group=flight.group if index == 0 else None,
                error=error,
                loss_mask=loss_mask or [],
            ),
            key=key,
            headers=trace_headers(span),
        )
        flight.segments_sent[key], flight.last_sent_ns[key] = index + 1, now
        self.generated_tokens += len(tokens)

    async def load(self, announced: WeightVersion) -> bool:
        """Interrupt, load the announced file (the engine checks its sha256) in a thread while the partial
        segments go out (the two overlap: emitting them after the load cost arith ~6 % of its steps per second
        in four paired runs); False if refused.

        A missing or corrupted file, or one that does not load into the model (`load_into` copies nothing
        then), goes to `dead-letter`; the engine keeps its weights and its sequences go on (their partial
        segments out already: a later segment carries on from them).
        """
        started = time.perf_counter()
        weights = WeightsFile(Path(announced.uri), announced.version, announced.content_hash, announced.base_version)
        interrupted = self.engine.interrupt()
        loading = asyncio.ensure_future(asyncio.to_thread(self.engine.update_weights, weights))
        try:
            for seq in interrupted:  # the load leaves the sequences' tokens as they are
                flight = self.groups[prompt_id_of(seq.key)]
                if len(flight.conversations[seq.key].with_turn(seq)[0]) > flight.tokens_sent.get(seq.key, 0):
                    await self.emit(seq, "interrupted")
                    self.interrupted += 1
        finally:  # a failed emit (or a stop) still waits for the load: no thread is left writing the weights
            (error,) = await asyncio.gather(loading, return_exceptions=True)  # update_weights returns None
        if isinstance(error, UNLOADABLE):
            self.refused_version = announced.version
            self.ctx.log.warning(
                "weights refused, keeping the current ones", version=announced.version, reason=str(error)
            )
            await self.outbox.dead_letter(
                DeadLetter(
                    origin=self.ctx.id,
                    source=self.outbox.layout.name("weights"),
                    reason=str(error),
                    payload=encode(announced),
                )
            )
            return False
        if error is not None:  # not a refused file: the worker ends on it
            raise error
        seconds = time.perf_counter() - started
        self.load_seconds, self.loads = self.load_seconds + seconds, self.loads + 1
        self.ctx.log.info("weights loaded", version=announced.version, seconds=round(seconds, 4))
        return True

    async def step(self) -> list[InFlight]:
        """Go on with answered calls, then one decode step; returns groups whose trajectories are now all
        emitted. A turn ending with a call is answered in a thread (`answer`) while the engine goes on.

        A decode step (~7 ms on a CPU) runs on the loop's own thread, and the loop serves Kafka between steps:
        handing each one to a thread and back cost ~10 % of a two-worker chain run's steps per second where
        processes share cores (two thread wake-ups per step, each waiting for a core; docs: Benchmarks, history).
        A step that prefills (admitted requests, or every running one after a weight load) can take seconds:
        it runs in a thread, so that the loop never stops for that long (heartbeats, `topics/clients.py`).
        """
        ended = [await self.next_turn(key, conversation) for key, conversation in self.answered]
        self.answered = []
        finished = []
        if not self.engine.idle():
            started, threaded = time.perf_counter(), self.prefills_next()
            finished = await asyncio.to_thread(self.engine.step) if threaded else self.engine.step()
            self.engine_seconds += time.perf_counter() - started
            self.engine_steps += 1
            if not threaded:
                await asyncio.sleep(0)  # the consumer's heartbeats and the producer's sends run between steps
        for seq in finished:
            conversation = self.groups[prompt_id_of(seq.key)].conversations[seq.key]
            if is_call(seq, self.call_token) and conversation.calls < self.workflow.max_calls:
                task = asyncio.create_task(self.answer(seq, conversation))
                self.answering.add(task)
                task.add_done_callback(self.answering.discard)
            else:
                ended.append(await self.emit(seq, seq.finish_reason or "length"))
        done = []
        for flight in filter(None, ended):
            flight.unfinished -= 1
            if flight.unfinished == 0:
                done.append(self.groups.pop(flight.group.prompt_id))
        return done

    def report(self, metrics: runtime.MetricsWriter) -> None:
        """The worker's counts so far, one metrics line."""
        metrics.write(
            step=self.engine.version,
            worker=self.ctx.id,
            generated_tokens=self.generated_tokens,
            interrupted_segments=self.interrupted,
            weight_loads=self.loads,
            weights_load_seconds=round(self.load_seconds, 4),
            engine_steps=self.engine_steps,
            engine_tokens=self.engine.stats().generated_tokens,
            engine_seconds=round(self.engine_seconds, 4),
        )

    def prefills_next(self) -> bool:
        """Whether the engine's next step prefills: sequences a weight load left to recompute, or waiting
        requests it has room to admit."""
        stats = self.engine.stats()
        return stats.prefilling > 0 or (stats.queued > 0 and stats.running - stats.queued < stats.capacity)

    async def answer(self, seq: Sequence, conversation: Conversation) -> None:
        """Append the workflow's reply to the call ending `seq` to its conversation; `step` sends both as a
        `tool` segment and submits the next turn."""
        text = await asyncio.to_thread(self.workflow.respond, conversation.transcript(seq, self.tokenizer))
        conversation.add_reply(seq, text, self.tokenizer, self.params, self.workflow.max_reply_chars)
        self.answered.append((seq.key, conversation))

    async def next_turn(self, key: str, conversation: Conversation) -> InFlight | None:
        """Send the answered turn and submit the next one; with no room left, the trajectory ends (its group)."""
        if (turn := conversation.next_turn(self.params)) is None:
            return await self.emit(None, "length", key=key)
        await self.emit(None, "tool", key=key)
        self.engine.submit(key, *turn)
        return None


async def main(config: RunConfig, stop: asyncio.Event, transport: Transport | None = None) -> None:
    ctx = runtime.WorkerContext.start(config, "rollout", transport)
    torch.set_num_threads(config.rollout.threads)
    building = asyncio.ensure_future(asyncio.to_thread(make_engine, config))  # meanwhile the group join waits
    async with (
        ctx.transport.outbox() as outbox,
        ctx.transport.inbox(
            "prompts",
            PromptGroup,
            outbox,
            origin=ctx.id,
            group=ROLLOUT_GROUP,
            alone=config.launcher.sole_consumers and config.rollout.workers == 1,
            max_records=64,
        ) as prompts,
        ctx.transport.weights_follower(outbox, origin=ctx.id) as weights_inbox,
    ):
        check = AnnouncementCheck(load_key(ctx.run_dir), verify_file=False)  # `load` verifies the sha256
        rollout, weights = Rollout(ctx, outbox, await building), WeightsFollower(weights_inbox, check)
        ctx.log.info("rollout started", max_batch=config.rollout.max_batch, interrupt=config.rollout.interrupt)
        await generate(rollout, prompts, weights, stop)
        await prompts.commit(now=True)
        ctx.log.info("rollout finished", version=rollout.engine.version, interrupted_segments=rollout.interrupted)


async def generate(
    rollout: Rollout, prompts: Inbox[PromptGroup], weights: WeightsFollower, stop: asyncio.Event
) -> None:
    """The loop, between two decode steps: load a newer version (at once, or once the engine has drained
    without `rollout.interrupt`), take in and admit the groups that arrived, then one engine step."""
    interrupt, metrics = rollout.ctx.config.rollout.interrupt, rollout.ctx.metrics()
    waiting: list[InFlight] = []
    last_report, profiler = time.monotonic(), step_profiler(rollout.ctx)
    while not stop.is_set():
        latest = await weights.poll()
        new_version = rollout.wants(latest)
        loads = new_version and (interrupt or rollout.engine.idle())
        if loads and await rollout.load(latest) and latest.final:
            break
        arrived = await prompts.poll(0 if waiting or not rollout.engine.idle() else 0.05)
        waiting += await screen(prompts, arrived, rollout.engine.vocab)
        await admit(rollout, prompts, waiting, holding=new_version and not interrupt)
        await prompts.commit()
        if rollout.engine.idle() and not rollout.answered:  # calls being answered come back meanwhile
            await asyncio.sleep(0.005)
            continue
        for flight in await rollout.step():
            prompts.done(flight.delivery)
        profiler.step()
        if time.monotonic() - last_report > METRICS_PERIOD_S:
            rollout.report(metrics)
            last_report = time.monotonic()
    profiler.close()


async def screen(prompts: Inbox[PromptGroup], arrived: list[Delivery[PromptGroup]], vocab: int) -> list[InFlight]:
    """The groups the model can generate from; a prompt outside its vocabulary goes to `dead-letter` with the
    reason, unanswered (the trainer drops its group when it sees the release)."""
    flights = []
    for delivery in arrived:
        if problem := outside_vocab(vocab, prompt_tokens=delivery.message.prompt_tokens):
            await prompts.reject(delivery, problem)
        else:
            flights.append(InFlight(delivery, unfinished=delivery.message.n_samples))
    return flights


async def admit(rollout: Rollout, prompts: Inbox[PromptGroup], waiting: list[InFlight], holding: bool) -> None:
    """Start the waiting groups the engine's version may generate (released at it or before); none while
    `holding` (draining for a weight update without interruption)."""
    ready = [] if holding else [f for f in waiting if f.group.released_at_version <= rollout.engine.version]
    for flight in ready:
        waiting.remove(flight)
        if not await rollout.start(flight):
            prompts.done(flight.delivery)
