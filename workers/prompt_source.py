"""The prompt source: dataset rows -> prompt groups on `prompts`, under the staleness bound.

It follows `weights` for the trainer's version and dropped count and releases a
group only while N < (i + eta + 1) * B + dropped + the skips it expects next
(`workers.staleness.skips_ahead`), and never more groups than the run's steps can
train (steps * B + dropped), so every released group ends up trained or dropped.
After a restart it reads back what `prompts` already holds and continues after the
last released row.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable
from dataclasses import replace

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from schemas.config import RunConfig
from schemas.messages import DeadLetter, PromptGroup, WeightVersion
from topics.tracing import trace_headers
from topics.transport import Outbox, Transport, WeightsFollower
from workers import runtime
from workers.announce import AnnouncementCheck, load_key
from workers.models import check_chat_template, context_positions, encode_prompt
from workers.rows import BadRow, Row, load_rows
from workers.staleness import may_release, skips_ahead


def prompt_problem(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase, positions: int | None, text: str
) -> str | None:
    """Why a prompt cannot be trained on, or None: it would lose characters the tokenizer cannot represent
    (silently, or as unknown tokens), or leave no room for rollout.max_new_tokens within the model's positions
    (the rollout would cut it short, a model with learned positions would fail in the trainer)."""
    data, room = config.data, config.rollout.max_new_tokens
    given_back = tokenizer.decode(
        tokenizer(text, add_special_tokens=False)["input_ids"],
        skip_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    if given_back != text:
        lost = [c for c in dict.fromkeys(text) if c not in given_back][:5]
        what = ", ".join(map(repr, lost)) if lost else f"the text (it decodes to {given_back[:40]!r})"
        return f"the tokenizer cannot represent {what}: the prompt would not be what the row says"
    ids = encode_prompt(tokenizer, text, data.template, data.system_prompt)
    if not ids:
        return "the prompt tokenises to nothing"
    if positions is not None and len(ids) + room > positions:
        return f"prompt of {len(ids)} tokens + rollout.max_new_tokens={room} exceeds the model's {positions} positions"
    return None


def fit_rows(config: RunConfig, tokenizer: PreTrainedTokenizerBase, rows: list[Row]) -> tuple[list[Row], list[BadRow]]:
    """The rows whose prompts the model can take (`prompt_problem`), indexed anew, and the others as bad rows
    with their line numbers: the prompt source dead-letters them, the pre-flight counts them."""
    positions = context_positions(config.model.path)
    fit, bad = [], []
    for row in rows:
        if problem := prompt_problem(config, tokenizer, positions, row.prompt):
            bad.append(BadRow(row.line, row.prompt, problem))
        else:
            fit.append(replace(row, index=len(fit)))
    return fit, bad


def epoch_order(n_rows: int, epoch: int, seed: int) -> list[int]:
    order = list(range(n_rows))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


class Cursor:
    """Where the source is in the dataset: an epoch, and a position in that epoch's seeded order."""

    def __init__(self, rows: list[Row], seed: int, epoch: int = 0, position: int = 0):
        self.rows, self.seed, self.epoch, self.position = rows, seed, epoch, position
        self.order = epoch_order(len(rows), epoch, seed)
        if position == len(rows):
            self._next_epoch()

    @classmethod
    def after(cls, rows: list[Row], seed: int, released: list[PromptGroup]) -> Cursor:
        """Just past the last group already on `prompts` (a restart), or at the start."""
        if not released:
            return cls(rows, seed)
        last = max(released, key=lambda g: g.release_index)
        return cls(rows, seed, last.epoch, epoch_order(len(rows), last.epoch, seed).index(last.row_index) + 1)

    def take(self) -> tuple[Row, int]:
        """The next row and its epoch; moves on."""
        row, epoch = self.rows[self.order[self.position]], self.epoch
        self.position += 1
        if self.position == len(self.rows):
            self._next_epoch()
        return row, epoch

    def _next_epoch(self) -> None:
        self.epoch, self.position = self.epoch + 1, 0
        self.order = epoch_order(len(self.rows), self.epoch, self.seed)


INITIAL = WeightVersion(version=0, uri="", content_hash="", step=0, groups_consumed=0, groups_dropped=0)


class Source:
    """The dataset as prompt groups: in seeded order, after what `prompts` already holds, within the bound."""

    def __init__(self, config: RunConfig, rows: list[Row], released: list[PromptGroup]):
        self.config, self.cursor = config, Cursor.after(rows, config.seed, released)
        self.released = len({g.prompt_id for g in released})  # N of the bound
        self.next_index = max((g.release_index for g in released), default=-1) + 1  # past a hole a crash left
        self.skipped_by: dict[int, int] = {}  # version -> the trainer's skips when it was first announced
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        if config.data.template == "chat":  # once here rather than a confusing failure per prompt
            check_chat_template(self.tokenizer)

    @property
    def exhausted(self) -> bool:
        return self.cursor.epoch >= self.config.data.epochs

    def follow(self, version: WeightVersion) -> None:
        """Note the trainer's skips as of `version`'s first announcement (`skips_ahead` reads the recent ones)."""
        self.skipped_by.setdefault(version.version, version.groups_skipped)

    def may_release(self, version: WeightVersion) -> bool:
        """Another group fits the staleness bound, widened by the skips expected ahead (`skips_ahead`), and
        the run's steps can still train it."""
        cfg = self.config.trainer
        needed = cfg.steps * cfg.batch_groups + version.groups_dropped
        return (
            self.released < needed
            and not self.exhausted
            and may_release(
                self.released,
                version.version,
                cfg.batch_groups,
                cfg.max_staleness,
                version.groups_dropped,
                cfg.max_in_flight,
                skips_ahead(self.skipped_by, version.version, cfg.max_staleness),
            )
        )

    def next_group(self, version: WeightVersion) -> PromptGroup:
        row, epoch = self.cursor.take()
        self.released, self.next_index = self.released + 1, self.next_index + 1
        data = self.config.data
        return PromptGroup(
            prompt_id=f"e{epoch}-r{row.index}",
            row_index=row.index,
            epoch=epoch,
            release_index=self.next_index - 1,
            released_at_version=version.version,
            prompt_text=row.prompt,
            prompt_tokens=encode_prompt(self.tokenizer, row.prompt, data.template, data.system_prompt),
            answer=row.answer,
            metadata=row.metadata,
            n_samples=data.n_samples,
        )


async def main(config: RunConfig, stop: asyncio.Event, transport: Transport | None = None) -> None:
    ctx = runtime.WorkerContext.start(config, "prompts", transport)
    rows, bad = load_rows(config)
    rows, unfit = fit_rows(config, AutoTokenizer.from_pretrained(config.model.path), rows)
    bad = sorted(bad + unfit, key=lambda row: row.line)
    released = [
        r.message for r in await ctx.transport.read_all("prompts", PromptGroup) if isinstance(r.message, PromptGroup)
    ]
    source = Source(config, rows, released)
    ctx.log.info("prompt source started", rows=len(rows), bad_rows=len(bad), already_released=source.released)
    async with ctx.transport.outbox() as outbox, ctx.transport.weights_follower(outbox, origin=ctx.id) as inbox:
        # signed, and the file there: the source loads no weights, so it leaves their sha256 to the workers that do
        weights = WeightsFollower(inbox, AnnouncementCheck(load_key(ctx.run_dir), verify_file=False))
        for row in bad if not released else ():  # a restarted source sent them already
            letter = DeadLetter(
                origin=ctx.id,
                source=config.data.source,
                reason=str(row),
                payload=row.text.encode(errors="surrogateescape"),
                offset=row.line,
            )
            await outbox.dead_letter(letter)
        if not rows:
            raise SystemExit(f"{config.data.source}: no usable rows (each bad row is on dead-letter)")
        version = INITIAL
        while not stop.is_set() and not source.exhausted:
            version = await weights.poll(0 if source.released == 0 else 0.1) or INITIAL
            if version.final:
                break
            source.follow(version)
            deliveries = []
            while source.may_release(version):
                deliveries.append(await release(ctx, outbox, source.next_group(version)))
            # together: one at a time, each waited out the producer's linger; a crash meanwhile may deliver later
            # groups of other partitions and not an earlier one (a row left out this epoch; `next_index` skips it)
            await asyncio.gather(*deliveries)
        ctx.log.info("prompt source finished", released=source.released, version=version.version)


async def release(ctx: runtime.WorkerContext, outbox: Outbox, group: PromptGroup) -> Awaitable:
    """One group queued on `prompts` (await the result for its delivery), in a new trace: every span of its
    journey descends from this one."""
    with ctx.tracer.start_as_current_span(
        "release prompt",
        attributes={
            "asyncrl.prompt_id": group.prompt_id,
            "asyncrl.release_index": group.release_index,
            "asyncrl.version": group.released_at_version,
        },
    ):
        return await outbox.send("prompts", group, key=group.prompt_id, headers=trace_headers())
