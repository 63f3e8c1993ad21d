"""The reward worker: segments -> whole trajectories -> rewards -> `scored`.

Segments of one attempt are joined in order once the terminal one arrives; the
first attempt of a trajectory id to finish wins and later ones are ignored. A
reward function that raises or times out gives the failure reward with the
error in `reward_details`; the worker goes on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiokafka import TopicPartition
from opentelemetry import trace
from opentelemetry.context import Context
from transformers import AutoTokenizer

from schemas.config import RunConfig
from schemas.messages import TERMINAL_REASONS, Scored, Segment
from topics.clients import make_group_consumer, make_producer, send
from topics.commits import CommitTracker
from topics.dead_letter import decode_or_dead_letter
from topics.tracing import context_of, trace_headers
from workers import runtime
from workers.reward.pool import ScoringPool


@dataclass
class Attempt:
    segments: dict[int, Segment] = field(default_factory=dict)
    records: list[tuple[TopicPartition, int]] = field(default_factory=list)
    trace: Context | None = None  # from the latest segment's headers: the prompt's trace

    def complete(self) -> list[Segment] | None:
        """The segments in order, once the terminal one and all before it are here."""
        last = next((s.segment_index for s in self.segments.values() if s.finish_reason in TERMINAL_REASONS), None)
        if last is None or any(i not in self.segments for i in range(last + 1)):
            return None
        return [self.segments[i] for i in range(last + 1)]


def assemble(segments: list[Segment], completion_text: str, reward: float, details: dict[str, str]) -> Scored:
    group = segments[0].group
    return Scored(
        trajectory_id=segments[0].trajectory_id, prompt_id=group.prompt_id,
        sample_index=int(segments[0].trajectory_id.rsplit("/", 1)[1]), n_samples=group.n_samples,
        release_index=group.release_index, released_at_version=group.released_at_version,
        attempt=segments[0].attempt, prompt_tokens=group.prompt_tokens,
        completion_tokens=[t for s in segments for t in s.token_ids],
        logprobs=[lp for s in segments for lp in s.logprobs],
        versions=[s.version for s in segments for _ in s.token_ids],
        finish_reason=segments[-1].finish_reason, num_segments=len(segments),
        reward=reward, reward_details=details, completion_text=completion_text,
    )


def check(segments: list[Segment]) -> str | None:
    """Why these segments cannot make a trajectory, or None."""
    if segments[0].group is None:
        return "segment 0 carries no prompt group"
    if any(len(s.token_ids) != len(s.logprobs) for s in segments):
        return "a segment has a different number of tokens and logprobs"
    return None


async def main(config: RunConfig, stop: asyncio.Event) -> None:
    me = runtime.worker_id("reward")
    log = runtime.configure_logging(runtime.run_dir(config) / "logs" / f"{me}.jsonl")
    layout, bootstrap = runtime.topic_layout(config), runtime.bootstrap(config)
    runtime.configure_tracing(config, "reward")
    tracer = trace.get_tracer(__name__)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    pool = ScoringPool(config.data.reward, config.reward.processes, config.reward.timeout_s)
    attempts: dict[tuple[str, str], Attempt] = {}  # (trajectory id, attempt) -> segments so far
    finished: set[str] = set()  # trajectory ids already scored (first attempt wins)
    commits = CommitTracker()

    async def score(key: tuple[str, str], attempt: Attempt, segments: list[Segment]) -> None:
        text = tokenizer.decode([t for s in segments for t in s.token_ids], skip_special_tokens=True)
        problem = check(segments) or next((f"generation failed: {s.error}" for s in segments if s.finish_reason == "error"), None)
        if problem and segments[0].group is None:
            log.error("trajectory cannot be assembled", trajectory=key[0], reason=problem)
        else:
            group = segments[0].group
            with tracer.start_as_current_span("score trajectory", context=attempt.trace,
                                              attributes={"asyncrl.trajectory_id": key[0], "asyncrl.attempt": key[1]}) as span:
                reward, details = (None, {"error": problem}) if problem else await pool.score(group.prompt_text, text, {**group.metadata, "answer": group.answer})
                if reward is None:
                    reward = config.reward.failure_reward
                    log.warning("scoring failed", trajectory=key[0], **details)
                span.set_attribute("asyncrl.reward", reward)
                await send(producer, layout.name("scored"), assemble(segments, text, reward, details), key=group.prompt_id,
                           headers=trace_headers())
        for tp, offset in attempt.records:
            commits.finished(tp, offset)

    async with (
        make_producer(bootstrap, linger_ms=5) as producer,
        make_group_consumer(bootstrap, layout.name("segments"), f"{layout.prefix}reward",
                            listener=commits.rebalance_listener(), max_poll_records=512,
                            **runtime.consumer_settings(config)) as consumer,
    ):
        log.info("reward worker started", reward=config.data.reward, processes=config.reward.processes)
        last_commit, scoring = time.monotonic(), set()
        while not stop.is_set():
            for tp, records in (await consumer.getmany(timeout_ms=50)).items():
                for record in records:
                    commits.started(tp, record.offset)
                    segment = await decode_or_dead_letter(record, Segment, producer, dead_letter_topic=layout.name("dead-letter"), origin=me)
                    if segment is None or segment.trajectory_id in finished:
                        commits.finished(tp, record.offset)
                        continue
                    key = (segment.trajectory_id, segment.attempt)
                    attempt = attempts.setdefault(key, Attempt())
                    attempt.segments[segment.segment_index] = segment
                    attempt.records.append((tp, record.offset))
                    attempt.trace = context_of(record)
                    if (segments := attempt.complete()) is not None:
                        finished.add(segment.trajectory_id)
                        del attempts[key]
                        for other in [k for k in attempts if k[0] == segment.trajectory_id]:  # losing attempts
                            for where in attempts.pop(other).records:
                                commits.finished(*where)
                        task = asyncio.create_task(score(key, attempt, segments))
                        scoring.add(task)
                        task.add_done_callback(scoring.discard)
            if time.monotonic() - last_commit > 0.5 and (offsets := commits.to_commit()):
                await producer.flush()
                await consumer.commit(offsets)
                last_commit = time.monotonic()
        await asyncio.gather(*scoring)
        pool.close()
        log.info("reward worker finished", scored=len(finished))
