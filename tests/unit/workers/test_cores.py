"""Cores lent between a run's workers: the split, the ledger's locks between processes, when nothing is lent."""

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.config import load_config, on_one_machine, resolve
from workers.cores import CoreLedger, ledger_for, split_cores


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


def test_threads_0_are_resolved_from_the_runs_cores_and_given_ones_kept():
    config = resolve(load_config(None, ["cores=6", "rollout.workers=2", "broker.partitions=2"]))
    assert (config.trainer.threads, config.rollout.threads) == (2, 2)
    config = resolve(load_config(None, ["cores=6", "trainer.threads=1"]))
    assert (config.trainer.threads, config.rollout.threads) == (1, 5)  # the rest to the other role
    assert on_one_machine(load_config(None, ["cores=5"])).cores == 5  # given: kept
    assert on_one_machine(load_config(None, [])).cores == len(os.sched_getaffinity(0))  # asyncrl run: the launcher's
    deployment = resolve(load_config(None, []))  # cores 0: compose or Slurm replicas, whose cores are unknown here
    assert (deployment.trainer.threads, deployment.rollout.threads) == (1, 1)


def test_a_core_is_held_by_one_ledger_at_a_time(tmp_path: Path):
    trainer, rollout = CoreLedger(tmp_path, 2), CoreLedger(tmp_path, 2)
    assert trainer.take(1) == 1 and rollout.take(1) == 1
    assert trainer.take(2) == 0  # every core held: nothing to borrow
    rollout.keep(0)  # idle: leaves its core
    assert trainer.take(2) == 1 and len(trainer.held) == 2
    trainer.keep(1)
    assert rollout.take(1) == 1 and trainer.held.isdisjoint(rollout.held)


def test_hold_waits_until_the_core_is_given_back(tmp_path: Path):
    trainer, rollout = CoreLedger(tmp_path, 1), CoreLedger(tmp_path, 1)
    trainer.take(1)
    waiter = threading.Thread(target=rollout.hold, args=(1,))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive() and not rollout.held  # the trainer's step is on it
    trainer.keep(0)
    waiter.join(timeout=5)
    assert not waiter.is_alive() and rollout.held == {0}


def test_a_killed_process_keeps_no_core(tmp_path: Path):
    code = (
        "from pathlib import Path; from workers.cores import CoreLedger; "
        f"c = CoreLedger(Path({str(tmp_path)!r}), 2); c.take(2); print(1, flush=True); import time; time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"
        ledger = CoreLedger(tmp_path, 2)
        assert ledger.take(2) == 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert ledger.take(2) == 2


def test_the_trainer_borrows_nothing_while_a_rollout_worker_waits_for_its_core(tmp_path: Path):
    trainer, rollout = CoreLedger(tmp_path, 2), CoreLedger(tmp_path, 2)
    trainer.take(2)  # stepping on both
    waiter = threading.Thread(target=rollout.hold, args=(1,))
    waiter.start()
    time.sleep(0.05)
    trainer.keep(1)  # the step ended
    assert trainer.borrow(1) in (0, 1)  # the waiter may have its core already
    waiter.join(timeout=5)
    assert rollout.held and len(trainer.held) == 1
    assert not list(tmp_path.glob("wanted-*"))  # its wish is gone with the wait
    stopped = CoreLedger(tmp_path, 2)
    assert stopped.hold(1, stopped=lambda: True) is False  # a stop ends the wait


@pytest.mark.parametrize(
    ("overrides", "lent"),
    [
        (["cores=2", "trainer.borrow_cores=true"], True),
        (["cores=2"], False),  # not asked for
        (["cores=0", "trainer.borrow_cores=true"], False),  # workers on several machines
        (["cores=2", "trainer.borrow_cores=true", "trainer.ranks=2"], False),  # ranks step together
        (["cores=2", "trainer.borrow_cores=true", "trainer.threads=2"], False),  # 3 threads on 2 cores at once
    ],
)
def test_cores_are_lent_only_on_one_machine_to_one_rank_within_the_cores(tmp_path: Path, overrides, lent):
    ledger = ledger_for(resolve(load_config(None, overrides)), tmp_path)
    assert (ledger is not None) == lent


def test_the_trainer_steps_on_the_free_cores_and_gives_them_back(tmp_path: Path):
    """In an executor thread, as the trainer's loop runs its step: torch's thread count is per thread."""
    import torch

    from workers.trainer.worker import Lead

    seen = []
    trainer = SimpleNamespace(train=lambda groups: seen.append(torch.get_num_threads()) or {"loss": 0.0})
    own, rollout = CoreLedger(tmp_path, 2), CoreLedger(tmp_path, 2)
    lead = SimpleNamespace(cores=own, cfg=SimpleNamespace(threads=1), trainer=trainer)
    own.take(1)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(torch.set_num_threads, 1).result()
        assert pool.submit(Lead.train_on_free_cores, lead, []).result() == {"loss": 0.0, "threads": 2}  # idle rollout
        assert len(own.held) == 1 and pool.submit(torch.get_num_threads).result() == 1
        rollout.take(1)
        assert pool.submit(Lead.train_on_free_cores, lead, []).result()["threads"] == 1  # it generates: its own core
    assert seen == [2, 1]
