"""A run's cores: each role's share of threads, and the evaluator's idle priority given back."""

import os

import pytest
from msgspec.structs import replace

from pipeline.config import load_config, on_one_machine, resolve
from schemas.config import LauncherState
from workers.cores import auto_dtype, native_bf16_cpu, split_cores


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


@pytest.mark.parametrize(
    ("flags", "native"),
    [("fpu avx2 avx512f avx512_bf16", True), ("fpu avx2 amx_bf16 amx_tile", True), ("fpu avx2 avx512f", False)],
)
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: a CPU\nflags\t\t: {flags}\n")
    assert native_bf16_cpu(str(cpuinfo)) is native
    assert native_bf16_cpu(str(tmp_path / "absent")) is False  # not Linux: float32, never the slow choice


@pytest.mark.parametrize(
    ("device", "width", "native", "expected"),
    [
        ("cuda", 0, False, "bfloat16"),
        ("cuda:1", 576, False, "bfloat16"),
        ("cpu", 576, True, "bfloat16"),  # SmolLM2-135M on a CPU with native bfloat16
        ("cpu", 576, False, "float32"),
        ("cpu", 192, True, "float32"),  # the demo model: overhead-bound, float32 everywhere on a CPU
        ("cpu", 0, True, "float32"),  # no model yet (the demo's is built later)
    ],
)
def test_auto_dtype_is_bfloat16_on_cuda_and_for_a_wide_model_on_a_native_bf16_cpu(
    monkeypatch, device, width, native, expected
):
    monkeypatch.setattr("workers.cores.native_bf16_cpu", lambda: native)
    assert auto_dtype(device, width) == expected


def test_the_automatic_token_budget_is_per_device_and_a_given_one_is_kept():
    from workers.cores import token_budget

    assert token_budget("auto", "cpu") == 1024
    assert token_budget("auto", "cuda") == 16384
    assert token_budget("auto", "cuda:1") == 16384
    assert token_budget(24, "cuda") == 24
