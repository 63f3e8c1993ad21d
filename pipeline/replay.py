"""Replay a run from its topics: tail any topic, rebuild a trajectory, explain a step,
rescore the trajectories with another reward function.

Everything shown is read back from the records the workers wrote (segments,
scored, batches), never recomputed, so replay shows what the run really did;
rescore alone computes something new, and sets it beside the recorded rewards.
Records come from a live broker or from an export file (`asyncrl topics
export`), since a run on the embedded broker loses its broker when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import groupby
from typing import Any, NamedTuple, Protocol

import msgspec

from pipeline.config import ConfigError, load_config
from schemas.config import RunConfig
from schemas.messages import (
    TOPIC_MESSAGE,
    BatchManifest,
    DeadLetter,
    Message,
    PromptGroup,
    Scored,
    Segment,
    WeightVersion,
)
from schemas.validate import DecodeError, decode
from topics.assembly import Attempt
from topics.export import TopicsExport
from topics.inspect import RawRecord, TopicOffsets, read_records
from topics.names import BATCHES, PROMPTS, ROLES, SCORED, SEGMENTS, TopicLayout
from topics.transport import SCHEMA_HEADER
from workers.reward import functions
from workers.reward.pool import ScoringPool

_SCHEMAS: dict[str, type[Message]] = {cls.__name__: cls for cls in TOPIC_MESSAGE.values()}
_ID_FIELDS: dict[type[Message], str] = {
    PromptGroup: "prompt_id",
    Segment: "trajectory_id",
    Scored: "trajectory_id",
    WeightVersion: "version",
    BatchManifest: "step",
    DeadLetter: "origin",
}
_PRETTY_VALUE_CHARS = 160

TokenDecoder = Callable[[list[int]], str]  # token ids -> text, e.g. a tokenizer's `decode`


class RunTopics(Protocol):
    """Where replay reads a run's records from."""

    layout: TopicLayout

    async def read(self, role: str, from_offset: int = 0) -> list[RawRecord]: ...


@dataclass
class BrokerTopics:
    bootstrap: str
    layout: TopicLayout

    async def read(self, role: str, from_offset: int = 0) -> list[RawRecord]:
        return await read_records(self.bootstrap, self.layout.name(role), from_offset=from_offset)


@dataclass
class ExportedTopics:
    export: TopicsExport
    layout: TopicLayout = field(init=False)

    def __post_init__(self) -> None:
        self.layout = TopicLayout(self.export.header.prefix, self.export.partitions)

    async def read(self, role: str, from_offset: int = 0) -> list[RawRecord]:
        return [record for record in self.export.records[role] if record.offset >= from_offset]


class Replayed(NamedTuple):
    """One record with its decoded message (or why it does not decode)."""

    topic: str
    record: RawRecord
    message: Message | DecodeError


def resolve_role(layout: TopicLayout, topic: str) -> str:
    """A role ("scored") or the topic's name on the broker ("run7.scored") -> the role."""
    role = topic if topic in ROLES else layout.role_of(topic)
    if role is None:
        raise LookupError(f"{topic!r} is neither a topic role {ROLES} nor a topic of prefix {layout.prefix!r}")
    return role


def decode_record(topic: str, role: str, record: RawRecord) -> Replayed:
    """Decode by the record's `schema` header, else by the message type of its topic."""
    schema = next((value.decode(errors="replace") for name, value in record.headers if name == SCHEMA_HEADER), "")
    cls = _SCHEMAS.get(schema, TOPIC_MESSAGE[role])
    try:
        return Replayed(topic, record, decode(record.value or b"", cls))
    except DecodeError as error:
        return Replayed(topic, record, error)


def matches_id(replayed: Replayed, wanted: str) -> bool:
    """The message's id is `wanted`, or starts with `wanted/` (a prompt id finds its trajectories)."""
    message = replayed.message
    if isinstance(message, DecodeError):
        found = _text(replayed.record.key)
    else:
        found = str(getattr(message, _ID_FIELDS[type(message)]))
    return found == wanted or found.startswith(wanted + "/")


async def tail(
    source: RunTopics,
    topic: str,
    *,
    message_id: str | None = None,
    from_offset: int | None = None,
    limit: int | None = None,
) -> list[Replayed]:
    """The decoded records of `topic`, in time order, filtered by id.

    `limit` keeps the last N, or the first N when reading from an offset.
    """
    replayed = await _replayed(source, resolve_role(source.layout, topic), from_offset or 0)
    chosen = [r for r in replayed if message_id is None or matches_id(r, message_id)]
    chosen.sort(key=lambda r: (r.record.timestamp, r.record.partition, r.record.offset))
    if limit is None:
        return chosen
    return chosen[:limit] if from_offset is not None else chosen[max(len(chosen) - limit, 0) :]


def as_json(replayed: Replayed) -> str:
    """One JSON line: where the record is, its key and headers, and the message's fields."""
    record, message = replayed.record, replayed.message
    return json.dumps({
        "topic": replayed.topic,
        "partition": record.partition,
        "offset": record.offset,
        "timestamp": record.timestamp,
        "key": _text(record.key),
        "headers": {name: value.decode(errors="replace") for name, value in record.headers},
        "schema": _schema_name(message),
        "message": {"error": str(message)} if isinstance(message, DecodeError) else msgspec.to_builtins(message),
    })  # fmt: skip


def pretty(replayed: Replayed) -> str:
    """A heading line, then one line per field; long values are cut (--json has them whole)."""
    record, message = replayed.record, replayed.message
    when = datetime.fromtimestamp(record.timestamp / 1000, UTC).isoformat(timespec="milliseconds")
    heading = (
        f"{replayed.topic} partition {record.partition} offset {record.offset}  {when}  "
        f"key={_text(record.key)!r}  {_schema_name(message)}"
    )
    if isinstance(message, DecodeError):  # one line whatever the bytes were: the reason, never a traceback
        return f"{heading}: {' '.join(str(message).split())}"
    fields = msgspec.to_builtins(message)
    return "\n".join([heading, *(f"  {name}: {_cut(json.dumps(value))}" for name, value in fields.items())])


@dataclass
class TrajectoryReplay:
    trajectory_id: str
    attempts: list[Attempt]  # in the order they first appear on `segments`
    scored: Scored | None  # the kept attempt, once a reward worker finished it

    @property
    def prompt(self) -> PromptGroup | None:
        return next((s.group for a in self.attempts for s in a.segments if s.group), None)


async def load_trajectory(source: RunTopics, trajectory_id: str) -> TrajectoryReplay:
    """Every attempt of one trajectory from `segments`, and its `scored` record if any."""
    segments = [m for m in await _messages(source, SEGMENTS, Segment) if m.trajectory_id == trajectory_id]
    scored = [m for m in await _messages(source, SCORED, Scored) if m.trajectory_id == trajectory_id]
    attempts: dict[str, Attempt[None]] = {}
    for segment in segments:  # a producer may deliver twice: the attempt keeps the first copy
        attempts.setdefault(segment.attempt, Attempt(trajectory_id, segment.attempt)).add(segment, None)
    return TrajectoryReplay(trajectory_id, list(attempts.values()), scored[0] if scored else None)


def render_trajectory(replay: TrajectoryReplay, decode_tokens: TokenDecoder) -> str:
    """The prompt, then per attempt its segments and each completion token with its version."""
    if not replay.attempts:
        return f"trajectory {replay.trajectory_id}: no segments on the topic"
    lines = [f"trajectory {replay.trajectory_id}"]
    if replay.prompt:
        lines.append(f"prompt: {json.dumps(replay.prompt.prompt_text)}")
    for attempt in replay.attempts:
        lines += ["", *_render_attempt(attempt, replay.scored, decode_tokens)]
    return "\n".join(lines)


@dataclass
class StepReplay:
    manifest: BatchManifest
    manifest_copies: int  # > 1 when the manifest of this step was written more than once
    trajectories: list[tuple[str, tuple[int, int], Scored | None]]  # id, (partition, offset), record there


async def load_step(source: RunTopics, step: int) -> StepReplay:
    """The `batches` manifest of `step` and the `scored` records at the offsets it names."""
    manifests = [m for m in await _messages(source, BATCHES, BatchManifest) if m.step == step]
    if not manifests:
        raise LookupError(f"no manifest of step {step} on {source.layout.name(BATCHES)!r}")
    manifest = manifests[-1]
    offsets = [tuple(position) for position in manifest.scored_offsets]
    first = min((offset for _, offset in offsets), default=0)
    at_offset = {(r.record.partition, r.record.offset): r.message for r in await _replayed(source, SCORED, first)}
    found = [at_offset.get(position) for position in offsets]
    return StepReplay(
        manifest,
        len(manifests),
        [
            (trajectory_id, position, message if isinstance(message, Scored) else None)
            for trajectory_id, position, message in zip(manifest.trajectory_ids, offsets, found, strict=True)
        ],
    )


def render_step(replay: StepReplay) -> str:
    """The manifest's trajectories with reward, staleness and token versions; then the dropped groups."""
    manifest = replay.manifest
    lines = [
        f"step {manifest.step}  trainer version {manifest.trainer_version}  "
        f"{len(manifest.trajectory_ids)} trajectories  {len(manifest.dropped)} dropped groups"
        + (
            f"  (manifest written {replay.manifest_copies} times; the last is shown)"
            if replay.manifest_copies > 1
            else ""
        )
    ]
    for trajectory_id, (partition, offset), scored in replay.trajectories:
        lines.append(_render_trained(trajectory_id, partition, offset, scored, manifest.trainer_version))
    if manifest.dropped:
        lines.append("dropped:")
        lines += [f"  {group.prompt_id}: {group.reason}" for group in manifest.dropped]
    return "\n".join(lines)


@dataclass
class Rescored:
    """One recorded trajectory scored again: the reward it was trained with beside the new one."""

    scored: Scored  # as recorded on `scored`
    reward: float  # the new reward; the failure reward when scoring failed
    details: dict[str, str]  # the reward function's details, or the failure
    failed: bool

    @property
    def changed(self) -> bool:
        return not self.failed and self.reward != self.scored.reward


async def rescore(source: RunTopics, pool: ScoringPool, failure_reward: float, concurrency: int) -> list[Rescored]:
    """Every trajectory of `scored` (its first copy) scored again by `pool` as the reward worker scores it:
    the group's prompt text, the decoded completion, the row's metadata plus the reference answer."""
    recorded: dict[str, Scored] = {}
    for message in await _messages(source, SCORED, Scored):
        recorded.setdefault(message.trajectory_id, message)
    if not recorded:
        raise LookupError(f"no trajectory on {source.layout.name(SCORED)!r} to rescore")
    groups = {group.prompt_id: group for group in await _messages(source, PROMPTS, PromptGroup)}
    if any(s.prompt_id not in groups for s in recorded.values()):  # segment 0 of each attempt carries its group too
        for segment in await _messages(source, SEGMENTS, Segment):
            if segment.group is not None:
                groups.setdefault(segment.group.prompt_id, segment.group)
    slots = asyncio.Semaphore(concurrency)  # a call's time limit runs from its submission: never queue in the pool

    async def one(scored: Scored) -> Rescored:
        group = groups.get(scored.prompt_id)
        if group is None:
            return Rescored(
                scored, failure_reward, {"error": f"no prompt group {scored.prompt_id} on prompts or segments"}, True
            )
        if scored.finish_reason == "error":  # the reward worker gives these the failure reward unscored
            return Rescored(
                scored, failure_reward, {"error": f"generation failed: {scored.reward_details.get('error', '')}"}, True
            )
        async with slots:
            reward, details = await pool.score(
                group.prompt_text, scored.completion_text, {**group.metadata, "answer": group.answer}
            )
        return Rescored(scored, failure_reward if reward is None else reward, details, reward is None)

    return list(await asyncio.gather(*(one(scored) for scored in recorded.values())))


def rescore_summary(results: Sequence[Rescored], reward: str) -> dict:
    """Counts, mean rewards before and after, and every trajectory whose reward changed or failed."""
    return {
        "reward": reward,
        "trajectories": len(results),
        "same": sum(not r.failed and not r.changed for r in results),
        "changed": sum(r.changed for r in results),
        "failed": sum(r.failed for r in results),
        "mean_reward_old": statistics.fmean(r.scored.reward for r in results),
        "mean_reward_new": statistics.fmean(r.reward for r in results),
        "differences": [
            {"trajectory_id": r.scored.trajectory_id, "old_reward": r.scored.reward, "new_reward": r.reward,
             "failed": r.failed, "details": r.details}
            for r in results if r.changed or r.failed
        ],
    }  # fmt: skip


def render_rescore(summary: dict) -> str:
    """Old -> new reward of each trajectory that differs (a failure with its first error line), then the totals."""
    lines = [f"rescored {summary['trajectories']} trajectories with {summary['reward']}"]
    for d in summary["differences"]:
        line = f"  {d['trajectory_id']}  {d['old_reward']:g} -> {d['new_reward']:g}"
        if d["failed"]:  # the error's first line; --json has all of it
            line += "  failed: " + d["details"].get("error", "").partition("\n")[0]
        lines.append(line)
    lines.append(f"same {summary['same']}  changed {summary['changed']}  failed {summary['failed']}")
    lines.append(f"mean reward {summary['mean_reward_old']:.4g} -> {summary['mean_reward_new']:.4g}")
    return "\n".join(lines)


def version_runs(versions: Sequence[int]) -> str:
    """[3, 3, 4] -> 'v3×2 v4×1': the versions of a completion, in token order."""
    return " ".join(f"v{version}×{len(list(run))}" for version, run in groupby(versions)) or "no tokens"


def _render_attempt(attempt: Attempt, scored: Scored | None, decode_tokens: TokenDecoder) -> list[str]:
    lines = [f"attempt {attempt.attempt}  {_attempt_fate(attempt, scored)}"]
    for segment in attempt.segments:
        error = f"  error: {segment.error}" if segment.error else ""
        lines.append(
            f"  segment {segment.segment_index}  @v{segment.version}  {segment.finish_reason}  "
            f"{len(segment.token_ids)} tokens  worker {segment.worker_id}{error}"
        )
    tokens = " ".join(  # a tool token (loss mask 0) is marked @tool: it is not trained, its version is none
        f"{_visible(decode_tokens([token]))}@{f'v{version}' if trained else 'tool'}"
        for token, version, trained in zip(attempt.token_ids, attempt.versions, attempt.loss_mask, strict=True)
    )
    lines += [
        f"  text: {json.dumps(decode_tokens(attempt.token_ids))}",
        f"  tokens: {tokens}",
        f"  versions: {version_runs(attempt.versions)}",
    ]
    if scored and scored.attempt == attempt.attempt and scored.versions != attempt.versions:
        lines.append(f"  scored versions differ from the segments: {version_runs(scored.versions)}")
    return lines


def _attempt_fate(attempt: Attempt, scored: Scored | None) -> str:
    if scored is None:
        return "(no scored record)"
    if scored.attempt != attempt.attempt:
        return "(not kept)"
    return f"(kept in scored: reward {scored.reward:g}, {scored.finish_reason})"


def _render_trained(
    trajectory_id: str, partition: int, offset: int, scored: Scored | None, trainer_version: int
) -> str:
    where = f"scored {partition}:{offset}"
    if scored is None:
        return f"  {trajectory_id}  {where}  MISSING: no scored record at that offset"
    if scored.trajectory_id != trajectory_id:
        return f"  {trajectory_id}  {where}  MISMATCH: the offset holds {scored.trajectory_id}"
    return (
        f"  {trajectory_id}  {where}  reward {scored.reward:g}  released at v{scored.released_at_version}  "
        f"staleness {trainer_version - scored.released_at_version}  {version_runs(scored.versions)}  "
        f"{scored.finish_reason}  {json.dumps(scored.completion_text)}"
    )


async def _replayed(source: RunTopics, role: str, from_offset: int = 0) -> list[Replayed]:
    name = source.layout.name(role)
    return [decode_record(name, role, raw) for raw in await source.read(role, from_offset)]


async def _messages(source: RunTopics, role: str, cls: type[Message]) -> list[Any]:
    return [r.message for r in await _replayed(source, role) if isinstance(r.message, cls)]


def _schema_name(message: Message | DecodeError) -> str:
    return "undecodable" if isinstance(message, DecodeError) else type(message).__name__


def _text(data: bytes | None) -> str:
    return "" if data is None else data.decode(errors="backslashreplace")


def _cut(text: str) -> str:
    if len(text) <= _PRETTY_VALUE_CHARS:
        return text
    return f"{text[:_PRETTY_VALUE_CHARS]}… ({len(text) - _PRETTY_VALUE_CHARS} more chars)"


def _visible(token_text: str) -> str:
    """A token's text on one line, with spaces made visible."""
    return json.dumps(token_text, ensure_ascii=False)[1:-1].replace(" ", "␣")


# The `asyncrl topics` and `asyncrl replay` commands (parsed in pipeline/commands/topics.py and replay.py).


def topics_command(args: argparse.Namespace) -> int:
    """List topics with offsets per partition, or export/import a run's topics."""
    from topics.export import export_topics, import_topics
    from topics.inspect import describe_topics

    bootstrap, prefix, _ = _broker_of(args)
    if args.action == "export":
        counts = asyncio.run(export_topics(bootstrap, args.out, prefix))
        print(f"exported {sum(counts.values())} records to {args.out}: {_counts(counts)}")
    elif args.action == "import":
        counts = asyncio.run(import_topics(args.file, bootstrap, prefix))
        print(f"imported {sum(counts.values())} records into {bootstrap} (prefix {prefix!r}): {_counts(counts)}")
    else:
        print(render_topic_offsets(asyncio.run(describe_topics(bootstrap, prefix))))
    return 0


def render_topic_offsets(topics: Sequence[TopicOffsets]) -> str:
    """Per topic its partitions, message count, and each partition's first and end offsets."""
    lines: list[str] = []
    for topic in topics:
        lines.append(f"{topic.name}  {len(topic.partitions)} partitions  {topic.count} messages")
        lines += [
            f"  partition {partition}  offsets {offsets.start}..{offsets.end}  {offsets.count} messages"
            for partition, offsets in sorted(topic.partitions.items())
        ]
    return "\n".join(lines) or "no topics"


def replay_command(args: argparse.Namespace) -> int:
    """`replay tail|trajectory|step|rescore`: print what the run's topics recorded (or a new reward's verdict)."""
    source, config = _source_of(args)
    if args.what == "tail":
        chosen = asyncio.run(
            tail(source, args.topic, message_id=args.id, from_offset=args.from_offset, limit=args.limit)
        )
        if not chosen:
            raise LookupError(f"no message on {args.topic!r} matches")
        print(("\n" if args.json else "\n\n").join(as_json(r) if args.json else pretty(r) for r in chosen))
    elif args.what == "trajectory":
        if config is None or not config.model.path:
            raise ConfigError("replay trajectory needs --config with model.path (its tokenizer decodes the tokens)")
        replay = asyncio.run(load_trajectory(source, args.trajectory_id))
        print(render_trajectory(replay, load_token_decoder(config.model.path)))
    elif args.what == "rescore":
        summary = rescore_summary(asyncio.run(rescore_run(source, config or RunConfig(), args)), args.reward)
        print(json.dumps(summary) if args.json else render_rescore(summary))
    elif args.what == "retrain":
        return retrain_command(source, config, args.step)
    else:
        print(render_step(asyncio.run(load_step(source, args.step))))
    return 0


def retrain_command(source: RunTopics, config: RunConfig | None, step: int) -> int:
    """Exit 0 when the retrained weights equal the recorded ones (to 1e-5: several ranks reduce in another order)."""
    from pipeline.retrain import load_record, render, retrain

    if config is None:
        raise ConfigError("replay retrain needs --config (the run's checkpoints, weights and trainer settings)")
    manifests, scored = load_record(asyncio.run(source.read("batches")), asyncio.run(source.read("scored")))
    result = retrain(config, step, manifests, scored)
    print(render(result))
    return 0 if max(result.max_abs_diff.values()) <= 1e-5 else 1


async def rescore_run(source: RunTopics, config: RunConfig, args: argparse.Namespace) -> list[Rescored]:
    """`--reward` checked as the run config checks `data.reward` and loaded here, so a bad one is a
    one-line error before any scoring; the pool, time limit and failure reward are the run's."""
    try:
        msgspec.structs.replace(config, data=msgspec.structs.replace(config.data, reward=args.reward))
        functions.load(args.reward, config.data.task)
    except Exception as exc:  # the user's module: a syntax error or a failing import is as bad as a missing one
        raise ConfigError(
            f"--reward: {exc if isinstance(exc, ValueError) else f'{type(exc).__name__}: {exc}'}"
        ) from None
    # a new reward function is not trusted the way a run's inline one was: at least one scoring process
    processes = max(config.reward.processes, 1) if args.processes is None else args.processes
    timeout_s = config.reward.timeout_s if args.timeout is None else args.timeout
    if processes < 1 or timeout_s <= 0:
        raise ConfigError("--processes and --timeout must be positive")
    pool = ScoringPool(args.reward, processes, timeout_s, config.data.task)
    try:
        return await rescore(source, pool, config.reward.failure_reward, processes)
    finally:
        pool.close()


def load_token_decoder(model_path: str) -> TokenDecoder:
    """The decode function of the run's tokenizer, special tokens kept visible."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=False)


def _source_of(args: argparse.Namespace) -> tuple[RunTopics, RunConfig | None]:
    if args.export:
        from topics.export import load_export

        return ExportedTopics(load_export(args.export)), _config_of(args)
    bootstrap, prefix, config = _broker_of(args)
    return BrokerTopics(bootstrap, TopicLayout(prefix)), config


def _broker_of(args: argparse.Namespace) -> tuple[str, str, RunConfig | None]:
    """Bootstrap and prefix: the options given, else the run config's."""
    config = _config_of(args)
    bootstrap = args.bootstrap or (config.broker.bootstrap if config else "")
    prefix = args.prefix if args.prefix is not None else (config.broker.topic_prefix if config else "")
    if not bootstrap:
        raise ConfigError("no broker: give --bootstrap HOST:PORT or --config with broker.bootstrap")
    return bootstrap, prefix, config


def _config_of(args: argparse.Namespace) -> RunConfig | None:
    return load_config(args.config) if args.config else None


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{role} {count}" for role, count in counts.items())
