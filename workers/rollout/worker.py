"""The rollout worker: prompt groups -> version-tagged segments, never waiting for training.

Between two decode steps it looks at `weights`: on a newer version it emits what
every in-flight sequence generated since its last segment (finish reason
`interrupted`), loads the new weights in place and lets the engine recompute the
KV cache of every unfinished prefix. With `rollout.interrupt=false` it instead
stops admitting, lets in-flight sequences finish on the old weights, then loads.
A prompt's offset is committed only once all of its trajectories are emitted.
`rollout.backend` picks the engine: the embedded torch one, or vLLM (same interface).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import torch
from aiokafka import TopicPartition
from opentelemetry import trace
from opentelemetry.context import Context
from transformers import AutoModelForCausalLM, AutoTokenizer

from schemas.config import RunConfig
from schemas.messages import PromptGroup, Segment, WeightVersion
from topics.clients import assigned_consumer, make_group_consumer, make_producer, send
from topics.commits import CommitTracker
from topics.dead_letter import decode_or_dead_letter
from topics.tracing import context_of, trace_headers
from workers import runtime
from workers.rollout.engine import Engine, SamplingParams, Sequence


@dataclass
class InFlight:
    """One prompt group being generated, and where its record sits in `prompts`."""

    group: PromptGroup
    tp: TopicPartition
    offset: int
    unfinished: int
    trace: Context  # the prompt's trace, from the record's headers
    attempts: dict[str, str] = field(default_factory=dict)  # trajectory id -> attempt id
    segments_sent: dict[str, int] = field(default_factory=dict)  # trajectory id -> segments emitted
    tokens_sent: dict[str, int] = field(default_factory=dict)  # trajectory id -> tokens emitted
    last_sent_ns: dict[str, int] = field(default_factory=dict)  # trajectory id -> when its last segment left


def make_engine(config: RunConfig):
    """The configured backend at version 0: an Engine, or a VLLMEngine (same interface)."""
    if config.rollout.backend == "vllm":
        from workers.rollout.vllm_engine import VLLMEngine  # vLLM itself is imported only here

        return VLLMEngine(config.model.path, max_batch=config.rollout.max_batch, version=0, seed=config.seed)
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    return Engine(model.to(torch.device(config.model.device)), max_batch=config.rollout.max_batch, version=0,
                  seed=config.seed)


class Rollout:
    def __init__(self, config: RunConfig, me: str, producer, topic: str):
        self.me, self.producer, self.topic = me, producer, topic
        eos = AutoTokenizer.from_pretrained(config.model.path).eos_token_id
        self.engine = make_engine(config)
        cfg = config.rollout
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                     max_new_tokens=cfg.max_new_tokens, stop_token_ids=(eos,) if eos is not None else ())
        self.groups: dict[str, InFlight] = {}  # prompt id -> group
        self.counter = itertools.count()
        self.interrupted = 0  # segments cut by a new version
        self.generated_tokens = 0  # every token emitted, interrupted runs included
        self.tracer = trace.get_tracer(__name__)

    async def start(self, flight: InFlight) -> bool:
        """Submit the group's samples; a prompt the engine refuses ends as `error` segments.

        False when nothing is left to generate: the refused prompt, or a redelivered
        group already in flight here.
        """
        if flight.group.prompt_id in self.groups:
            return False
        self.groups[flight.group.prompt_id] = flight
        keys = [f"{flight.group.prompt_id}/{sample}" for sample in range(flight.group.n_samples)]
        for key in keys:
            flight.attempts[key] = f"{self.me}:{next(self.counter)}"
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

    async def emit(self, seq: Sequence, finish_reason: str) -> InFlight:
        """Send the tokens of `seq` generated since its last segment; returns its group."""
        flight = self.groups[seq.key.rsplit("/", 1)[0]]
        start = flight.tokens_sent.get(seq.key, 0)
        version = seq.versions[start] if start < len(seq.versions) else self.engine.version
        await self.send(flight, seq.key, version, seq.token_ids[start:], seq.logprobs[start:], finish_reason)
        flight.tokens_sent[seq.key] = len(seq.token_ids)
        return flight

    async def send(self, flight: InFlight, key: str, version: int, tokens: list[int], logprobs: list[float],
                   finish_reason: str, error: str = "") -> None:
        """One segment on `segments`, with a span (in the prompt's trace) covering its generation."""
        index = flight.segments_sent.get(key, 0)
        now = time.time_ns()
        span = self.tracer.start_span("generate segment", context=flight.trace, start_time=flight.last_sent_ns.get(key, now),
                                      attributes={"asyncrl.trajectory_id": key, "asyncrl.segment_index": index,
                                                  "asyncrl.version": version, "asyncrl.tokens": len(tokens),
                                                  "asyncrl.finish_reason": finish_reason})
        span.end(end_time=now)
        await send(self.producer, self.topic, Segment(
            trajectory_id=key, attempt=flight.attempts[key], segment_index=index, version=version, token_ids=tokens,
            logprobs=logprobs, finish_reason=finish_reason, worker_id=self.me,
            group=flight.group if index == 0 else None, error=error,
        ), key=key, headers=trace_headers(span))
        flight.segments_sent[key], flight.last_sent_ns[key] = index + 1, now
        self.generated_tokens += len(tokens)

    async def update_weights(self, announced: WeightVersion) -> None:
        """Interrupt: emit partial segments, load the version, recompute caches (in the engine)."""
        weights = await asyncio.to_thread(self.engine.fetch_weights, announced.uri)
        for seq in self.engine.running():
            if len(seq.token_ids) > self.groups[seq.key.rsplit("/", 1)[0]].tokens_sent.get(seq.key, 0):
                await self.emit(seq, "interrupted")
                self.interrupted += 1
        self.engine.update_weights(weights, announced.version)

    async def step(self) -> list[InFlight]:
        """One decode step; returns groups whose trajectories are now all emitted."""
        done = []
        for seq in await asyncio.to_thread(self.engine.step):
            flight = await self.emit(seq, seq.finish_reason or "length")
            flight.unfinished -= 1
            if flight.unfinished == 0:
                done.append(self.groups.pop(flight.group.prompt_id))
        return done


async def main(config: RunConfig, stop: asyncio.Event) -> None:
    me = runtime.worker_id("rollout")
    log = runtime.configure_logging(runtime.run_dir(config) / "logs" / f"{me}.jsonl")
    torch.set_num_threads(config.rollout.threads)
    runtime.configure_tracing(config, "rollout")
    layout, bootstrap = runtime.topic_layout(config), runtime.bootstrap(config)
    dead_letter = layout.name("dead-letter")
    commits, fetch = CommitTracker(), runtime.consumer_settings(config)
    async with (
        make_producer(bootstrap, linger_ms=5) as producer,
        make_group_consumer(bootstrap, layout.name("prompts"), f"{layout.prefix}rollout",
                            listener=commits.rebalance_listener(), max_poll_records=64, **fetch) as prompts,
        assigned_consumer(bootstrap, layout.name("weights"), **fetch) as weights,
    ):
        rollout = Rollout(config, me, producer, layout.name("segments"))
        waiting, latest = [], None
        log.info("rollout started", max_batch=config.rollout.max_batch, interrupt=config.rollout.interrupt)
        last_commit = last_report = time.monotonic()
        metrics = runtime.MetricsWriter(runtime.run_dir(config) / "metrics.jsonl", "rollout")
        while not stop.is_set():
            for record in (await weights.getmany(timeout_ms=0)).get(TopicPartition(layout.name("weights"), 0), []):
                announced = await decode_or_dead_letter(record, WeightVersion, producer, dead_letter_topic=dead_letter, origin=me)
                if announced and (latest is None or announced.version > latest.version):
                    latest = announced
            new_version = latest is not None and latest.version > rollout.engine.version
            if new_version and (config.rollout.interrupt or rollout.engine.idle()):
                try:
                    await rollout.update_weights(latest)
                    log.info("weights loaded", version=latest.version)
                    if latest.final:
                        break
                except FileNotFoundError:  # we fell behind the trainer's clean-up: wait for the next version
                    log.warning("weights already deleted, waiting for a newer version", version=latest.version)
                    latest = None
            busy = not rollout.engine.idle()
            for tp, records in (await prompts.getmany(timeout_ms=0 if busy or waiting else 50)).items():
                for record in records:
                    commits.started(tp, record.offset)
                    group = await decode_or_dead_letter(record, PromptGroup, producer, dead_letter_topic=dead_letter, origin=me)
                    if group is None:
                        commits.finished(tp, record.offset)
                    else:
                        waiting.append(InFlight(group, tp, record.offset, unfinished=group.n_samples, trace=context_of(record)))
            admit_now = not (new_version and not config.rollout.interrupt)
            ready = [f for f in waiting if admit_now and f.group.released_at_version <= rollout.engine.version]
            for flight in ready:
                waiting.remove(flight)
                if not await rollout.start(flight):
                    commits.finished(flight.tp, flight.offset)
            if rollout.engine.idle():
                await asyncio.sleep(0.005)
                continue
            for flight in await rollout.step():
                commits.finished(flight.tp, flight.offset)
            if time.monotonic() - last_commit > 0.5 and (offsets := commits.to_commit()):
                await producer.flush()  # everything emitted is on the broker before its prompt is committed
                await prompts.commit(offsets)
                last_commit = time.monotonic()
            if time.monotonic() - last_report > 1.0:
                metrics.write(step=rollout.engine.version, worker=me, generated_tokens=rollout.generated_tokens,
                              interrupted_segments=rollout.interrupted)
                last_report = time.monotonic()
        log.info("rollout finished", version=rollout.engine.version, interrupted_segments=rollout.interrupted)
