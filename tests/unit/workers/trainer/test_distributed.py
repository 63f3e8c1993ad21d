"""The ranks: the token-balanced division of a minibatch's rows (a pure function), the typed commands
rank 0 sends the others, and the one-process collective that exchanges nothing."""

from pathlib import Path

import pytest
import torch

from workers.trainer.checkpoint import TrainerState
from workers.trainer.distributed import ONE_PROCESS, Collective, balance_rows
from workers.trainer.ranks import GatherWeights, LeadRank, SaveCheckpoint, Stop, Train, follow


def test_longest_rows_go_to_the_rank_with_fewest_tokens():
    # 9 -> r0, 7 -> r1, 7 -> r1 (7 < 9), 5 -> r0 (9 < 14), 3 -> r0 (14 = 14, equal rows: lower rank), 2 -> r1
    assert balance_rows([5, 9, 2, 7, 7, 3], 2) == [[0, 1, 5], [2, 3, 4]]


def test_every_rank_gets_a_row_while_there_are_enough():
    assert balance_rows([0, 0, 0], 2) == [[0, 2], [1]]  # equal tokens: the rank with fewer rows first
    assert balance_rows([4, 6], 3) == [[1], [0], []]
    assert balance_rows([30, 4, 4, 5, 3, 6, 4, 5], 2) == [[0], [1, 2, 3, 4, 5, 6, 7]]


def test_one_rank_takes_everything_in_order():
    assert balance_rows([3, 1, 2], 1) == [[0, 1, 2]]


class Recorder:
    """A rank's `RankCommands` that only records what it is told."""

    def __init__(self):
        self.calls = []

    def train_batch(self, sequences, advantages):
        self.calls.append(("train_batch", sequences, advantages))
        return {"loss": 0.5}

    def gather_weights(self):
        self.calls.append(("gather_weights",))
        return {}

    def save_checkpoint(self, state):
        self.calls.append(("save_checkpoint", state.step))
        return Path(f"step_{state.step}.pt")

    def stop(self):
        self.calls.append(("stop",))


class Wire(Collective):
    """Two ranks in one process: what rank 0 broadcasts, rank 1 receives, in order."""

    world = 2

    def __init__(self, rank: int, sent: list):
        self.rank, self.sent = rank, sent

    def broadcast(self, value):
        if self.rank == 0:
            self.sent.append(value)
            return value
        return self.sent.pop(0)


def test_rank_zero_broadcasts_typed_commands_and_the_others_run_them_in_order():
    sent, lead, other = [], Recorder(), Recorder()
    commands = LeadRank(lead, Wire(0, sent))
    assert commands.train_batch([([1, 2], [3], [-0.5])], [1.0]) == {"loss": 0.5}
    assert commands.gather_weights() == {}
    assert commands.save_checkpoint(TrainerState(step=3)) == Path("step_3.pt")
    commands.stop()
    assert [type(command) for command in sent] == [Train, GatherWeights, SaveCheckpoint, Stop]
    follow(other, Wire(1, sent))  # returns at Stop
    assert (
        other.calls
        == lead.calls
        == [("train_batch", [([1, 2], [3], [-0.5])], [1.0]), ("gather_weights",), ("save_checkpoint", 3), ("stop",)]
    )


def test_a_method_name_is_not_a_command():
    with pytest.raises(TypeError, match="not a rank command"):
        follow(Recorder(), Wire(1, ["gather_weights"]))


def test_one_process_exchanges_nothing():
    stats = {"loss": 1.0}
    assert (ONE_PROCESS.world, ONE_PROCESS.rank) == (1, 0)
    assert ONE_PROCESS.broadcast(stats) is stats and ONE_PROCESS.gather(stats) == [stats]
    assert ONE_PROCESS.max(3, torch.device("cpu")) == 3
    total = torch.tensor([1.0, 2.0])
    assert ONE_PROCESS.sum(total) is total
