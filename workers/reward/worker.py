"""The reward worker: segments -> whole trajectories -> rewards -> `scored`.

Segments of one attempt are joined in order once the terminal one arrives; the
first attempt of a trajectory id to finish wins and later ones are ignored. A
reward function that raises or times out gives the failure reward with the
error in `reward_details`; the worker goes on.
"""

from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from schemas.config import RunConfig
from schemas.messages import Scored, Segment, split_trajectory_id
from topics.assembly import Attempt, SegmentAssembler
from topics.tracing import trace_headers
from topics.transport import Delivery, Inbox, Outbox, Transport
from workers import runtime
from workers.reward.pool import ScoringPool


def assemble(segments: list[Segment], completion_text: str, reward: float, details: dict[str, str]) -> Scored:
    group = segments[0].group
    return Scored(
        trajectory_id=segments[0].trajectory_id,
        prompt_id=group.prompt_id,
        sample_index=split_trajectory_id(segments[0].trajectory_id)[1],
        n_samples=group.n_samples,
        release_index=group.release_index,
        released_at_version=group.released_at_version,
        attempt=segments[0].attempt,
        prompt_tokens=group.prompt_tokens,
        completion_tokens=[t for s in segments for t in s.token_ids],
        logprobs=[lp for s in segments for lp in s.logprobs],
        versions=[s.version for s in segments for _ in s.token_ids],
        finish_reason=segments[-1].finish_reason,
        num_segments=len(segments),
        reward=reward,
        reward_details=details,
        completion_text=completion_text,
    )


def check(segments: list[Segment]) -> str | None:
    """Why these segments cannot make a trajectory, or None."""
    if segments[0].group is None:
        return "segment 0 carries no prompt group"
    if any(len(s.token_ids) != len(s.logprobs) for s in segments):
        return "a segment has a different number of tokens and logprobs"
    try:
        split_trajectory_id(segments[0].trajectory_id)
    except ValueError as error:
        return str(error)
    return None


class Scorer:
    """Scores a completed attempt in the pool and sends it to `scored`; its records are then done."""

    def __init__(self, ctx: runtime.WorkerContext, outbox: Outbox, inbox: Inbox[Segment]):
        self.ctx, self.outbox, self.inbox = ctx, outbox, inbox
        self.tokenizer = AutoTokenizer.from_pretrained(ctx.config.model.path)
        data, reward = ctx.config.data, ctx.config.reward
        self.pool = ScoringPool(data.reward, reward.processes, reward.timeout_s, data.task)
        self.tasks: set[asyncio.Task] = set()
        self.scored = 0

    def start(self, attempt: Attempt[Delivery[Segment]]) -> None:
        task = asyncio.create_task(self.score(attempt))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def score(self, attempt: Attempt[Delivery[Segment]]) -> None:
        segments = attempt.complete()
        text = self.tokenizer.decode([t for s in segments for t in s.token_ids], skip_special_tokens=True)
        failed = (f"generation failed: {s.error}" for s in segments if s.finish_reason == "error")
        problem = check(segments) or next(failed, None)
        if problem and segments[0].group is None:
            self.ctx.log.error("trajectory cannot be assembled", trajectory=attempt.trajectory_id, reason=problem)
        else:
            await self.send(attempt, segments, text, problem)
        for delivery in attempt.receipts:
            self.inbox.done(delivery)

    async def send(self, attempt: Attempt, segments: list[Segment], text: str, problem: str | None) -> None:
        group, reward_cfg = segments[0].group, self.ctx.config.reward
        with self.ctx.tracer.start_as_current_span(
            "score trajectory",
            context=attempt.receipts[-1].trace(),
            attributes={"asyncrl.trajectory_id": attempt.trajectory_id, "asyncrl.attempt": attempt.attempt},
        ) as span:
            metadata = {**group.metadata, "answer": group.answer}
            reward, details = (
                (None, {"error": problem}) if problem else await self.pool.score(group.prompt_text, text, metadata)
            )
            if reward is None:
                reward = reward_cfg.failure_reward
                self.ctx.log.warning("scoring failed", trajectory=attempt.trajectory_id, **details)
            span.set_attribute("asyncrl.reward", reward)
            await self.outbox.send(
                "scored", assemble(segments, text, reward, details), key=group.prompt_id, headers=trace_headers()
            )
        self.scored += 1

    async def close(self) -> None:
        await asyncio.gather(*self.tasks)
        self.pool.close()


async def main(config: RunConfig, stop: asyncio.Event, transport: Transport | None = None) -> None:
    ctx = runtime.WorkerContext.start(config, "reward", transport)
    assembler: SegmentAssembler[Delivery[Segment]] = SegmentAssembler()
    async with (
        ctx.transport.outbox() as outbox,
        ctx.transport.inbox("segments", Segment, outbox, origin=ctx.id, group="reward", max_records=512) as inbox,
    ):
        scorer = Scorer(ctx, outbox, inbox)
        ctx.log.info("reward worker started", reward=config.data.reward, processes=config.reward.processes)
        try:
            while not stop.is_set():
                for delivery in await inbox.poll(0.05):
                    added = assembler.add(delivery.message, delivery)
                    for released in added.released:  # late copies, losing attempts
                        inbox.done(released)
                    if added.completed is not None:
                        scorer.start(added.completed)
                await inbox.commit()
        finally:
            await scorer.close()
        await inbox.commit(now=True)
        ctx.log.info("reward worker finished", scored=scorer.scored)
