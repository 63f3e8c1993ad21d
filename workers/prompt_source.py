"""The prompt source: dataset rows -> prompt groups on `prompts`, under the staleness bound.

It follows `weights` for the trainer's version and dropped count and releases a
group only while N < (i + eta + 1) * B + dropped, and never more groups than the
run's steps can train (steps * B + dropped), so every released group ends up
trained or dropped. After a restart it reads back what `prompts` already holds
and continues after the last released row.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace
from transformers import AutoTokenizer

from schemas.config import RunConfig
from schemas.messages import DeadLetter, PromptGroup, WeightVersion
from topics.clients import assigned_consumer, make_producer, send_and_wait
from topics.dead_letter import decode_or_dead_letter, send_dead_letter
from topics.readers import read_topic
from topics.tracing import trace_headers
from workers import builtin_task, runtime
from workers.staleness import may_release


@dataclass(frozen=True)
class Row:
    index: int  # position in the dataset (for a file: 0-based among valid lines)
    prompt: str
    answer: str
    metadata: dict[str, str]


class BadRow(ValueError):
    def __init__(self, line: int, text: str, reason: str):
        super().__init__(f"line {line}: {reason}")
        self.line, self.text = line, text


def load_rows(config: RunConfig) -> tuple[list[Row], list[BadRow]]:
    """The training rows and the rows that could not be used (with their line numbers)."""
    if config.data.source == "builtin":
        train, _ = builtin_task.split_rows(config.seed, config.data.held_out)
        return [Row(i, r["prompt"], r["answer"], {}) for i, r in enumerate(train)], []
    rows, bad = [], []
    for number, line in enumerate(Path(config.data.source).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(parse_row(len(rows), line))
        except ValueError as exc:
            bad.append(BadRow(number, line, str(exc)))
    return rows, bad


def parse_row(index: int, line: str) -> Row:
    """One JSONL row: {"prompt": str, "answer": str|number, ...other fields kept as metadata}."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError("a row must be a JSON object")
    prompt, answer = data.pop("prompt", None), data.pop("answer", None)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("field 'prompt' must be a non-empty string")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise ValueError("field 'answer' must be a string or a number")
    return Row(index, prompt, str(answer), {k: v if isinstance(v, str) else json.dumps(v) for k, v in data.items()})


def epoch_order(n_rows: int, epoch: int, seed: int) -> list[int]:
    order = list(range(n_rows))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


async def main(config: RunConfig, stop: asyncio.Event) -> None:
    me = runtime.worker_id("prompts")
    log = runtime.configure_logging(runtime.run_dir(config) / "logs" / f"{me}.jsonl")
    layout, bootstrap = runtime.topic_layout(config), runtime.bootstrap(config)
    runtime.configure_tracing(config, "prompts")
    tracer = trace.get_tracer(__name__)
    cfg = config.trainer
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    rows, bad = load_rows(config)
    released = [r.message for r in await read_topic(bootstrap, layout.name("prompts"), PromptGroup) if isinstance(r.message, PromptGroup)]
    epoch, position = (0, 0)
    if released:
        last = max(released, key=lambda g: g.release_index)
        epoch, position = last.epoch, epoch_order(len(rows), last.epoch, config.seed).index(last.row_index) + 1
        if position == len(rows):
            epoch, position = epoch + 1, 0
    order = epoch_order(len(rows), epoch, config.seed)
    n_released = len({g.prompt_id for g in released})
    log.info("prompt source started", rows=len(rows), bad_rows=len(bad), already_released=n_released)
    version = WeightVersion(version=0, uri="", content_hash="", step=0, groups_consumed=0, groups_dropped=0)

    async with (
        make_producer(bootstrap) as producer,
        assigned_consumer(bootstrap, layout.name("weights"), **runtime.consumer_settings(config)) as weights,
    ):
        if not released:
            for row in bad:
                await send_dead_letter(producer, layout.name("dead-letter"), DeadLetter(
                    origin=me, source=config.data.source, reason=str(row), payload=row.text.encode(), offset=row.line))
        if not rows:
            raise SystemExit(f"{config.data.source}: no usable rows (each bad row is on dead-letter)")
        while not stop.is_set() and epoch < config.data.epochs:
            for records in (await weights.getmany(timeout_ms=0 if n_released == 0 else 100)).values():
                for record in records:
                    announced = await decode_or_dead_letter(record, WeightVersion, producer, dead_letter_topic=layout.name("dead-letter"), origin=me)
                    if announced and (announced.version, announced.groups_dropped) > (version.version, version.groups_dropped):
                        version = announced
            if version.final:
                break
            needed = cfg.steps * cfg.batch_groups + version.groups_dropped  # no group released that cannot be trained
            while n_released < needed and may_release(n_released, version.version, cfg.batch_groups, cfg.max_staleness, version.groups_dropped):
                row = rows[order[position]]
                group = PromptGroup(
                    prompt_id=f"e{epoch}-r{row.index}", row_index=row.index, epoch=epoch, release_index=n_released,
                    released_at_version=version.version, prompt_text=row.prompt,
                    prompt_tokens=tokenizer(row.prompt)["input_ids"], answer=row.answer, metadata=row.metadata,
                    n_samples=config.data.n_samples,
                )
                with tracer.start_as_current_span("release prompt", attributes={
                    "asyncrl.prompt_id": group.prompt_id, "asyncrl.release_index": n_released,
                    "asyncrl.version": version.version,
                }):
                    await send_and_wait(producer, layout.name("prompts"), group, key=group.prompt_id, headers=trace_headers())
                n_released += 1
                position += 1
                if position == len(rows):
                    epoch, position = epoch + 1, 0
                    if epoch >= config.data.epochs:
                        break
                    order = epoch_order(len(rows), epoch, config.seed)
        log.info("prompt source finished", released=n_released, version=version.version)
