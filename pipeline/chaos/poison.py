"""Poison: records no worker may trust, cut from the run's own messages, for every topic a worker reads.

`table` is one record of each kind a reader must refuse (bad numbers, lengths that disagree, ids in no shape,
ids outside the model, forged or broken weight announcements, bytes that are no message at all); `randomised`
adds seeded random bytes and mutations of valid encodings (a mutation that still decodes is a valid message,
not poison, and is not sent). Each record names the workers that must put it on `dead-letter` with a reason.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import msgspec

from schemas.messages import TOPIC_MESSAGE, Message, PromptGroup, Scored, Segment, WeightVersion, encode
from schemas.validate import DecodeError, decode

# Who reads each topic, and so must dead-letter what it cannot use (one rollout worker).
READERS: dict[str, tuple[str, ...]] = {
    "prompts": ("rollout", "trainer"),
    "segments": ("reward",),
    "scored": ("trainer",),
    "weights": ("rollout", "prompts"),
}
# A kind cut from a real trajectory races the real records: poison that comes first must be refused without
# shutting the real ones out; poison that comes late is a losing attempt or a duplicate id, dropped unread. So no
# dead letter is required of it; what is required is checked by the audit: its group trained, the run finished.
RACING = ", racing the real records"
FORGED_VERSION = 1_000_000  # above any real version, so every weights reader looks at the forgery
UTF8_MARK, NOT_UTF8 = "zq~Q", b"\xff\xfe\xfd\xfc"  # same length: the MessagePack string header stays right


@dataclass(frozen=True)
class Poison:
    kind: str
    role: str  # the topic role it is produced to
    value: bytes | None
    readers: tuple[str, ...]  # the roles that must dead-letter it
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True)
class RunView:
    """What poison is cut from: the run as it is when poisoned."""

    group: PromptGroup  # the newest group released
    vocab: int  # the model's embeddings
    weights_uri: str  # a real version file, its sha256, and a corrupted copy of it
    weights_hash: str
    corrupt_uri: str


def templates(view: RunView) -> dict[str, Message]:
    """One valid message per topic, shaped as the run's own (sample 0 of the newest group)."""
    group, version = view.group, view.group.released_at_version
    sample = f"{group.prompt_id}/0"
    return {
        "prompts": group,
        "segments": Segment(
            trajectory_id=sample, attempt="chaos:0", segment_index=0, version=version, token_ids=[5, 6],
            logprobs=[-0.5, -0.25], finish_reason="stop", worker_id="chaos", group=group,
        ),
        "scored": Scored(
            trajectory_id=sample, prompt_id=group.prompt_id, sample_index=0, n_samples=group.n_samples,
            release_index=group.release_index, released_at_version=version, attempt="chaos:0",
            prompt_tokens=group.prompt_tokens, completion_tokens=[5, 6], logprobs=[-0.5, -0.25],
            versions=[version, version], finish_reason="stop", num_segments=1, reward=1.0,
        ),
        "weights": WeightVersion(
            version=FORGED_VERSION, uri=view.weights_uri, content_hash=view.weights_hash, step=FORGED_VERSION,
            groups_consumed=0, groups_dropped=0,
        ),
    }  # fmt: skip


def _headers(role: str, extra: tuple[tuple[str, bytes], ...] = ()) -> tuple[tuple[str, bytes], ...]:
    return (("schema", TOPIC_MESSAGE[role].__name__.encode()), *extra)


def _changed(kind: str, base: Message, role: str, readers: tuple[str, ...] | None = None, **changes) -> Poison:
    value = encode(msgspec.structs.replace(base, **changes))
    return Poison(kind, role, value, READERS[role] if readers is None else readers, _headers(role))


def _not_utf8(kind: str, base: Message, role: str, name: str) -> Poison:
    value = encode(msgspec.structs.replace(base, **{name: UTF8_MARK}))
    return Poison(kind, role, value.replace(UTF8_MARK.encode(), NOT_UTF8), READERS[role], _headers(role))


def table(view: RunView, rng: random.Random) -> list[Poison]:
    """One record of every kind, each on the topic whose readers must refuse it."""
    valid = templates(view)
    p, seg, sc, w = valid["prompts"], valid["segments"], valid["scored"], valid["weights"]
    outside = view.vocab + 3  # a valid int32, past the model's embeddings: only a worker holding the model knows
    return [
        *_numbers(seg, sc),
        _changed("scored: token id beyond the vocabulary", sc, "scored", completion_tokens=[5, outside]),
        _changed(f"scored: n_samples differs from its siblings{RACING}", sc, "scored", (), n_samples=p.n_samples + 1),
        _changed("scored: one logprob for three tokens", sc, "scored", completion_tokens=[5, 6, 7], logprobs=[-0.5],
                 versions=[*sc.versions, sc.versions[0]]),
        _changed("scored: empty token lists", sc, "scored", completion_tokens=[], logprobs=[], versions=[]),
        _changed("scored: empty prompt tokens", sc, "scored", prompt_tokens=[]),
        _changed("scored: negative versions", sc, "scored", versions=[-1, -1]),
        _changed("scored: loss mask longer than the completion", sc, "scored", loss_mask=[1, 0, 1]),
        _changed("scored: loss mask value 2", sc, "scored", loss_mask=[1, 2]),
        _changed("scored: tool calls in the terminal segment", sc, "scored", tool_calls=1),
        _changed("segments: loss mask shorter than the tokens", seg, "segments", loss_mask=[0]),
        _changed("segments: negative loss mask", seg, "segments", loss_mask=[1, -1]),
        _changed("segments: malformed trajectory id", seg, "segments", trajectory_id=p.prompt_id),
        _changed("segments: huge token id", seg, "segments", token_ids=[5, 2**40]),
        _changed("segments: token id beyond the vocabulary", seg, "segments", token_ids=[5, outside],
                 trajectory_id="chaos-unreleased/0", group=msgspec.structs.replace(p, prompt_id="chaos-unreleased")),
        _changed(f"segments: token id beyond the vocabulary{RACING}", seg, "segments", (), token_ids=[5, outside],
                 attempt="chaos:vocab"),
        _changed("segments: negative version", seg, "segments", version=-1),
        _changed("prompts: huge token id", p, "prompts", prompt_tokens=[5, 2**40]),
        _changed("prompts: token id beyond the vocabulary", p, "prompts", prompt_tokens=[5, outside],
                 prompt_id="chaos-forged", release_index=p.release_index + 1),
        _changed("prompts: n_samples = 0", p, "prompts", n_samples=0),
        _changed("prompts: empty prompt tokens", p, "prompts", prompt_tokens=[]),
        _changed("prompts: negative version", p, "prompts", released_at_version=-1),
        *_weights(view, w),
        *[_not_utf8(f"{role}: invalid UTF-8 in a string", valid[role], role, name)
          for role, name in (("prompts", "prompt_text"), ("segments", "attempt"), ("scored", "attempt"),
                             ("weights", "uri"))],
        *[Poison(f"{role}: random bytes", role, rng.randbytes(rng.randint(1, 64)), READERS[role], _headers(role))
          for role in READERS],
        *[Poison(f"{role}: null value (tombstone)", role, None, READERS[role]) for role in READERS],
    ]  # fmt: skip


def _numbers(seg: Segment, sc: Scored) -> list[Poison]:
    """Non-finite numbers where the trainer would turn them into a NaN loss."""
    return [
        _changed("segments: NaN logprob", seg, "segments", logprobs=[-0.5, math.nan]),
        _changed("segments: inf logprob", seg, "segments", logprobs=[-math.inf, -0.25]),
        _changed("scored: NaN logprob", sc, "scored", logprobs=[-0.5, math.nan]),
        _changed("scored: inf logprob", sc, "scored", logprobs=[math.inf, -0.25]),
        _changed("scored: NaN reward", sc, "scored", reward=math.nan),
    ]


def _weights(view: RunView, w: WeightVersion) -> list[Poison]:
    """Announcements not from this run's trainer (unsigned, or a wrong signature): the signature is checked
    first, so none of them moves a worker to a missing file, a corrupt one, or a stop."""
    wrong = (("asyncrl-signature", b"0" * 64),)
    return [
        _changed("weights: missing file", w, "weights", uri="/nonexistent/chaos/v1000000.safetensors"),
        _changed("weights: corrupt file", w, "weights", uri=view.corrupt_uri),
        _changed("weights: forged final", w, "weights", final=True),
        Poison("weights: forged final, wrong signature", "weights",
               encode(msgspec.structs.replace(w, final=True)), READERS["weights"], _headers("weights", wrong)),
        _changed("weights: negative version", w, "weights", version=-1, step=-1),
        _changed("weights: not a sha256", w, "weights", content_hash="0" * 63),
    ]  # fmt: skip


EXTREMES: tuple[object, ...] = (
    math.nan, math.inf, -math.inf, 1e308, -1, 0, 2**63 - 1, -(2**63), "", "x" * 5000, "e0-r1/x", [], [2**40],
    [-1], [math.nan], None, True, {"k": 1}, b"\xff", [[[[]]]],
)  # fmt: skip


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One to four byte-level edits: flip a bit, overwrite, insert, delete, truncate, repeat a slice."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data) or 1)
        edit = rng.randrange(6)
        if edit == 0 and data:
            data[at] ^= 1 << rng.randrange(8)
        elif edit == 1 and data:
            data[at] = rng.randrange(256)
        elif edit == 2:
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        elif edit == 3:
            del data[at : at + rng.randint(1, 8)]
        elif edit == 4:
            del data[at:]
        else:
            data[at:at] = data[at : at + rng.randint(1, 16)]
    return bytes(data)


def mutate_field(message: Message, rng: random.Random) -> bytes:
    """A valid message with one field (or one nested in its group) set to an extreme or wrongly typed value."""
    fields = msgspec.to_builtins(message)
    target = fields["group"] if isinstance(fields.get("group"), dict) and rng.random() < 0.3 else fields
    target[rng.choice(sorted(target))] = rng.choice(EXTREMES)
    if rng.random() < 0.1:
        target[f"unknown_{rng.randrange(10)}"] = 1
    return msgspec.msgpack.encode(fields)


def randomised(view: RunView, rng: random.Random, count: int) -> tuple[list[Poison], int]:
    """`count` random records over the four topics, and how many mutations were left unsent (still valid)."""
    valid, poisons, still_valid = templates(view), [], 0
    while len(poisons) < count:
        role = rng.choice(sorted(READERS))
        how = rng.choices(("random bytes", "mutated bytes", "mutated field"), (1, 2, 2))[0]
        if how == "random bytes":
            value = rng.randbytes(rng.choice((0, 1, 4, 32, 256, 2048)))
        elif how == "mutated bytes":
            value = mutate_bytes(encode(valid[role]), rng)
        else:
            value = mutate_field(valid[role], rng)
        if decodes(value, TOPIC_MESSAGE[role]):
            still_valid += 1
            continue
        poisons.append(Poison(f"random {role}: {how}", role, value, READERS[role], _headers(role)))
    return poisons, still_valid


def decodes(value: bytes, cls: type[Message]) -> bool:
    try:
        decode(value, cls)
    except DecodeError:
        return False
    return True
