"""What rank 0 tells the other trainer ranks to do: typed commands, dispatched explicitly.

Under torchrun every rank holds an FSDP2 shard, so training, gathering the weights
and checkpointing are collectives every rank must join, while rank 0 alone talks to
Kafka. Rank 0 goes through `LeadRank`, which broadcasts each command before running
it itself; the other ranks wait in `follow` and run what arrives. With one rank the
broadcast is the identity (`distributed.Collective`): the same code, nothing sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from workers.trainer.checkpoint import TrainerState
from workers.trainer.distributed import Collective
from workers.trainer.step import Sequences


class RankCommands(Protocol):
    """What every rank does together (each one a collective under FSDP2)."""

    def train_batch(self, sequences: Sequences, advantages: list[float]) -> dict[str, float]:
        """One optimizer step on the whole batch (each rank trains its share); the step's stats."""

    def gather_weights(self) -> dict[str, torch.Tensor]:
        """The whole, unsharded weights (rank 0; the other ranks get an empty dict)."""

    def save_checkpoint(self, state: TrainerState) -> Path:
        """Model, optimizer and `state` in one file written by rank 0; its path."""

    def stop(self) -> None:
        """The run is over: leave the process group."""


@dataclass(frozen=True)
class Train:
    sequences: Sequences
    advantages: list[float]


@dataclass(frozen=True)
class GatherWeights:
    pass


@dataclass(frozen=True)
class SaveCheckpoint:
    state: TrainerState


@dataclass(frozen=True)
class Stop:
    pass


Command = Train | GatherWeights | SaveCheckpoint | Stop


class LeadRank:
    """Rank 0's `RankCommands`: each command goes to the other ranks, then runs on this one too."""

    def __init__(self, local: RankCommands, ranks: Collective):
        self.local, self.ranks = local, ranks

    def train_batch(self, sequences: Sequences, advantages: list[float]) -> dict[str, float]:
        self.ranks.broadcast(Train(sequences, advantages))
        return self.local.train_batch(sequences, advantages)

    def gather_weights(self) -> dict[str, torch.Tensor]:
        self.ranks.broadcast(GatherWeights())
        return self.local.gather_weights()

    def save_checkpoint(self, state: TrainerState) -> Path:
        self.ranks.broadcast(SaveCheckpoint(state))
        return self.local.save_checkpoint(state)

    def stop(self) -> None:
        self.ranks.broadcast(Stop())
        self.local.stop()


def follow(local: RankCommands, ranks: Collective) -> None:
    """Ranks > 0: run each command rank 0 broadcasts, until `Stop`."""
    while True:
        command: Command = ranks.broadcast(None)
        match command:
            case Train(sequences, advantages):
                local.train_batch(sequences, advantages)
            case GatherWeights():
                local.gather_weights()
            case SaveCheckpoint(state):
                local.save_checkpoint(state)
            case Stop():
                local.stop()
                return
            case _:
                raise TypeError(f"rank {ranks.rank}: {command!r} is not a rank command")
