"""The reward worker: segments -> whole trajectories -> rewards -> `scored`.

Segments of one attempt are joined in order once the terminal one arrives; the
first attempt of a trajectory id to finish wins and later ones are ignored. A
reward function that raises, times out or returns no finite reward within ±1e6
gives the failure reward with the error in `reward_details` (its traceback logged
once per distinct error, then counted); the worker goes on, until more than
`reward.max_failure_rate` of a window of calls failed: then it stops the run
(`budget.py`). Segments that make no trajectory the trainer could take (no group,
a malformed id, token ids outside the model) go to `dead-letter` with the reason,
and their offsets are committed like any other.
"""

from __future__ import annotations

import asyncio
import time

from transformers import AutoConfig, AutoTokenizer

from schemas.config import RunConfig
from schemas.messages import Scored, Segment, split_trajectory_id
from topics.assembly import Attempt, SegmentAssembler, token_mask
from topics.names import REWARD_GROUP
from topics.tracing import trace_headers
from topics.transport import Delivery, Inbox, Outbox, Transport
from workers import runtime
from workers.reward.budget import EXIT_CODE, RewardFailures
from workers.reward.pool import scoring
from workers.vocab import outside_vocab

METRICS_PERIOD_S = 1.0


def assemble(segments: list[Segment], completion_text: str, reward: float, details: dict[str, str]) -> Scored:
    """The trajectory of a complete attempt; its loss mask stays empty while every token is a model token
    (single-turn trajectories are then what they were before tools)."""
    group, mask = segments[0].group, token_mask(segments)
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
        loss_mask=mask if 0 in mask else [],
        tool_calls=sum(s.finish_reason == "tool" for s in segments),
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
        self.vocab = AutoConfig.from_pretrained(ctx.config.model.path).get_text_config().vocab_size
        data, reward = ctx.config.data, ctx.config.reward
        self.pool = scoring(data.reward, reward.processes, reward.timeout_s, data.task, reward.max_processes)
        self.failures = RewardFailures(reward.max_failure_rate, reward.failure_window)
        self.tasks: set[asyncio.Task] = set()
        self.error: BaseException | None = None  # a scoring task's unexpected exception: the loop re-raises it
        self.scored = self.unscorable = 0
        self.reported: dict = {}  # the counts of the last metrics line

    def start(self, attempt: Attempt[Delivery[Segment]]) -> None:
        task = asyncio.create_task(self.score(attempt))
        self.tasks.add(task)
        task.add_done_callback(self.finished)

    def finished(self, task: asyncio.Task) -> None:
        """Every task's outcome is read: an unexpected error stops the worker (a restart re-reads the records)
        rather than vanish with its task and leave its offsets uncommitted for ever."""
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()

    def refusal(self, segments: list[Segment]) -> str | None:
        """Why a complete attempt makes no trajectory the trainer could take (None if it does). Asked before the
        attempt wins its trajectory, so that poison completing first cannot shut out the real attempt."""
        return check(segments) or outside_vocab(self.vocab, token_ids=[t for s in segments for t in s.token_ids])

    async def score(self, attempt: Attempt[Delivery[Segment]]) -> None:
        segments = attempt.complete()
        tokens = [t for s in segments for t in s.token_ids]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        failed = (f"generation failed: {s.error}" for s in segments if s.finish_reason == "error")
        await self.send(attempt, segments, text, next(failed, None))
        for delivery in attempt.receipts:
            self.inbox.done(delivery)

    async def dead_letter(self, attempt: Attempt[Delivery[Segment]], reason: str) -> None:
        """Every record of a refused attempt to `dead-letter`, with the reason (each then counts as processed)."""
        self.unscorable += 1
        self.ctx.log.warning("segments cannot be scored", trajectory=attempt.trajectory_id, reason=reason)
        for delivery in attempt.receipts:
            await self.inbox.reject(delivery, f"trajectory {attempt.trajectory_id!r} cannot be scored: {reason}")

    async def send(self, attempt: Attempt, segments: list[Segment], text: str, problem: str | None) -> None:
        group, reward_cfg = segments[0].group, self.ctx.config.reward
        with self.ctx.tracer.start_as_current_span(
            "score trajectory",
            context=attempt.receipts[-1].trace(),
            attributes={"asyncrl.trajectory_id": attempt.trajectory_id, "asyncrl.attempt": attempt.attempt},
        ) as span:
            metadata = {**group.metadata, "answer": group.answer}
            if problem:  # not the reward function's failure: outside its budget
                reward, details = None, {"error": problem}
            else:
                reward, details = await self.pool.score(group.prompt_text, text, metadata)
                if self.failures.record(details if reward is None else None):  # a new error: its traceback once
                    self.ctx.log.warning("reward function failed (each new error once)", **details)
            if reward is None:
                reward = reward_cfg.failure_reward
            span.set_attribute("asyncrl.reward", reward)
            await self.outbox.send(
                "scored", assemble(segments, text, reward, details), key=group.prompt_id, headers=trace_headers()
            )
        self.scored += 1

    def report(self, metrics: runtime.MetricsWriter, **extra: str) -> None:
        """A metrics line of the counts (summary.json sums them), when they changed since the last one."""
        failures = self.failures
        counts = {
            "step": self.scored,
            "scored": self.scored,
            "reward_calls": failures.calls,
            "reward_failed": sum(failures.by_kind.values()),
            "reward_failures": dict(failures.by_kind),
            "unscorable_segments": self.unscorable,
        }
        if counts != self.reported or extra:
            metrics.write(worker=self.ctx.id, **counts, **extra)
            self.reported = counts

    async def close(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)  # their errors were seen by `finished`
        self.pool.close()


async def main(config: RunConfig, stop: asyncio.Event, transport: Transport | None = None) -> None:
    ctx = runtime.WorkerContext.start(config, "reward", transport)
    async with (
        ctx.transport.outbox() as outbox,
        ctx.transport.inbox(  # `asyncrl run` starts one reward worker
            "segments",
            Segment,
            outbox,
            origin=ctx.id,
            group=REWARD_GROUP,
            alone=config.launcher.sole_consumers,
            max_records=512,
        ) as inbox,
    ):
        scorer, metrics, last_report, spent = Scorer(ctx, outbox, inbox), ctx.metrics(), time.monotonic(), False
        assembler: SegmentAssembler[Delivery[Segment]] = SegmentAssembler(refuse=scorer.refusal)
        ctx.log.info("reward worker started", reward=config.data.reward, processes=config.reward.processes)
        try:
            while not stop.is_set() and not (spent := scorer.failures.exceeded):
                if scorer.error is not None:
                    raise scorer.error
                for delivery in await inbox.poll(0.05):
                    added = assembler.add(delivery.message, delivery)
                    for released in added.released:  # late copies, losing attempts
                        inbox.done(released)
                    if added.completed is not None:
                        scorer.start(added.completed)
                    if added.refused is not None:
                        await scorer.dead_letter(added.refused, added.reason)
                await inbox.commit()
                if time.monotonic() - last_report > METRICS_PERIOD_S:
                    scorer.report(metrics)
                    last_report = time.monotonic()
        finally:
            await scorer.close()
        if spent:
            ctx.log.error("failure budget spent, stopping the run", verdict=scorer.failures.verdict())
        scorer.report(metrics, **({"stopped": scorer.failures.verdict()} if spent else {}))
        await inbox.commit(now=True)
        ctx.log.info("reward worker finished", scored=scorer.scored)
    if spent:
        raise SystemExit(EXIT_CODE)  # the launcher ends the run with the verdict of the metrics line
