"""Segments -> trajectories: the one join of version-tagged segments, for the reward worker and replay.

A trajectory is the segments 0..k of one attempt, the last one terminal (the
others ended "interrupted" or at a "tool" call). A producer may deliver a
segment twice and segments may arrive out of order; the first attempt of a
trajectory id to complete wins, and the others are released.
An assembler given a `refuse` check lets only an attempt it accepts win: one it
refuses (poison: tokens outside the model, no group) is handed back alone and
the trajectory stays open for the real attempt.
Each segment travels with a receipt of the caller's (a `Delivery`, or nothing),
so the caller learns which records need no further work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from schemas.messages import TERMINAL_REASONS, Segment, model_token_mask

R = TypeVar("R")


@dataclass
class Attempt(Generic[R]):
    """The segments of one attempt at one trajectory that have arrived, first copy of each index kept."""

    trajectory_id: str
    attempt: str
    by_index: dict[int, Segment] = field(default_factory=dict)
    receipts: list[R] = field(default_factory=list)

    def add(self, segment: Segment, receipt: R) -> None:
        self.by_index.setdefault(segment.segment_index, segment)
        self.receipts.append(receipt)

    @property
    def segments(self) -> list[Segment]:
        """Those that arrived, by segment index (gaps possible while incomplete)."""
        return [self.by_index[i] for i in sorted(self.by_index)]

    def complete(self) -> list[Segment] | None:
        """The segments in order, once the terminal one and all before it are here."""
        last = next((s.segment_index for s in self.segments if s.finish_reason in TERMINAL_REASONS), None)
        if last is None or any(i not in self.by_index for i in range(last + 1)):
            return None
        return [self.by_index[i] for i in range(last + 1)]

    @property
    def token_ids(self) -> list[int]:
        return [token for segment in self.segments for token in segment.token_ids]

    @property
    def versions(self) -> list[int]:
        """The policy version of each token."""
        return [segment.version for segment in self.segments for _ in segment.token_ids]

    @property
    def loss_mask(self) -> list[int]:
        return token_mask(self.segments)


def token_mask(segments: list[Segment]) -> list[int]:
    """1 per model token, 0 per environment (tool output) token, over the segments' tokens in order."""
    return [m for segment in segments for m in model_token_mask(segment.loss_mask, len(segment.token_ids))]


@dataclass
class Added(Generic[R]):
    """What one segment changed: a newly completed attempt, or one refused with the reason, and receipts that need
    no further work."""

    completed: Attempt[R] | None = None
    released: list[R] = field(default_factory=list)
    refused: Attempt[R] | None = None
    reason: str = ""


Refuse = Callable[[list[Segment]], str | None]  # why a complete attempt may not win its trajectory, or None


class SegmentAssembler(Generic[R]):
    """Joins segments into attempts; the first attempt of a trajectory to complete (and not be refused) wins."""

    def __init__(self, refuse: Refuse | None = None) -> None:
        self.attempts: dict[tuple[str, str], Attempt[R]] = {}  # (trajectory id, attempt) -> arrived so far
        self.finished: set[str] = set()  # trajectory ids whose winner is known
        self.refuse = refuse
        self.refused: set[tuple[str, str]] = set()  # attempts refused: a late copy of their segments is released

    def add(self, segment: Segment, receipt: R) -> Added[R]:
        """Take one segment. The completed (or refused) attempt's receipts are the caller's to release once it is
        handled; a late segment of a finished trajectory or a refused attempt and the losing attempts' receipts
        are released at once."""
        key = (segment.trajectory_id, segment.attempt)
        if segment.trajectory_id in self.finished or key in self.refused:
            return Added(released=[receipt])
        attempt = self.attempts.setdefault(key, Attempt(segment.trajectory_id, segment.attempt))
        attempt.add(segment, receipt)
        segments = attempt.complete()
        if segments is None:
            return Added()
        del self.attempts[key]
        if self.refuse is not None and (reason := self.refuse(segments)):
            self.refused.add(key)
            return Added(refused=attempt, reason=reason)
        self.finished.add(segment.trajectory_id)
        losers = [k for k in self.attempts if k[0] == segment.trajectory_id]
        return Added(attempt, [r for k in losers for r in self.attempts.pop(k).receipts])
