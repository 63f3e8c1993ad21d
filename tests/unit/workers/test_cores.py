"""A run's cores: each role's share of threads, and the evaluator's idle priority given back."""

import os

import pytest
from msgspec.structs import replace

from pipeline.config import load_config, on_one_machine, resolve
from schemas.config import LauncherState
from workers.cores import split_cores


@pytest.mark.parametrize(
    ("cores", "ranks", "workers", "expected"),
    [
        (2, 1, 1, (1, 1)),  # this machine: one core each
        (3, 1, 1, (2, 1)),  # the odd core goes to the trainer
        (16, 1, 1, (8, 8)),
        (16, 1, 3, (4, 4)),
        (16, 2, 2, (4, 4)),
        (1, 1, 1, (1, 1)),  # fewer cores than processes: one thread each all the same
        (7, 2, 1, (2, 2)),
    ],
)
def test_threads_are_an_equal_share_each_and_the_rest_to_the_trainer(cores, ranks, workers, expected):
    assert split_cores(cores, ranks, workers) == expected


@pytest.mark.parametrize(
    ("cores", "given", "expected"),
    [
        ((8, 2, 2), (0, 3), (1, 3)),
        ((8, 1, 2), (2, 0), (2, 3)),
        ((2, 1, 1), (4, 0), (4, 1)),
        ((4, 1, 1), (1, 1), (1, 1)),
    ],
)
def test_given_threads_are_kept_and_the_other_role_gets_the_rest(cores, given, expected):
    assert split_cores(*cores, *given) == expected


def on_cores(cores: int, *overrides: str):
    """A resolved config whose launcher has `cores` (0: a deployment)."""
    return resolve(replace(load_config(None, list(overrides)), launcher=LauncherState(cores=cores)))


def test_automatic_threads_are_resolved_from_the_launcher_s_cores_and_given_ones_kept():
    config = on_cores(6, "rollout.workers=2", "broker.partitions=2")
    assert (config.trainer.threads, config.rollout.threads) == (2, 2)
    config = on_cores(6, "trainer.threads=1")
    assert (config.trainer.threads, config.rollout.threads) == (1, 5)  # the rest to the other role
    assert on_one_machine(load_config()).launcher.cores == len(os.sched_getaffinity(0))  # asyncrl run: its own
    deployment = resolve(load_config(None, []))  # cores 0: compose or Slurm replicas, whose cores are unknown here
    assert (deployment.trainer.threads, deployment.rollout.threads) == (1, 1)
