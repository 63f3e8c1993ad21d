"""The run's cores on one machine: each role's share of torch threads (`split_cores`), and the evaluator's
place behind the workers: it runs under SCHED_IDLE (`lower_priority`), computing only on a core no worker wants.
"""

from __future__ import annotations

import contextlib
import os


def lower_priority() -> None:
    """Every thread of this process, and those it starts later, to SCHED_IDLE: it computes only on a core
    that no other process wants (nice 19 where there is no SCHED_IDLE)."""
    if not hasattr(os, "SCHED_IDLE"):
        os.nice(19)
        return
    set_policy("self", os.SCHED_IDLE)


def restore_priority(pid: int) -> None:
    """Process `pid`'s threads back from SCHED_IDLE to the normal policy where this process may (CAP_SYS_NICE,
    as root, or an RLIMIT_NICE of 20; measured: an unprivileged owner may not): once it alone wants the cores,
    an idle-class process would still wait behind any busy process of anyone's on the machine."""
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(FileNotFoundError, PermissionError):  # it has exited; not ours to raise
            set_policy(str(pid), os.SCHED_OTHER)


def set_policy(process: str, policy: int) -> None:
    for thread in os.listdir(f"/proc/{process}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setscheduler(int(thread), policy, os.sched_param(0))


def cores_here() -> int:
    """The cores this process may run on (its affinity mask, which Slurm and taskset narrow)."""
    return len(os.sched_getaffinity(0))


def split_cores(cores: int, ranks: int, workers: int, trainer: int = 0, rollout: int = 0) -> tuple[int, int]:
    """(threads per trainer rank, threads per rollout worker) on `cores`: the given ones (non-zero) kept, the
    others an equal share each, at least 1, with what is left over to the trainer, whose step is on every
    sample's path."""
    if not rollout:
        rollout = max(1, (cores - trainer * ranks) // workers) if trainer else max(1, cores // (ranks + workers))
    return trainer or max(1, (cores - rollout * workers) // ranks), rollout


def native_bf16_cpu(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX): there bfloat16 is the
    fast dtype (one Xeon core: 1,020 GFLOP/s in bfloat16 against 154 in float32 for a 512x1024 by 1024x1024
    product); elsewhere torch emulates it, slower than float32."""
    try:
        with open(cpuinfo) as lines:
            flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    except OSError:  # not Linux: no way to tell, and float32 is never the slow choice
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


BF16_MIN_WIDTH = 512  # hidden size from which bfloat16 matmuls pay on a CPU; narrower models are overhead-bound


def auto_dtype(device: str, width: int) -> str:
    """What model.dtype=auto becomes for a model of hidden size `width` (0: not built yet, the demo's): bfloat16
    on CUDA, and on a CPU with native bfloat16 for a model wide enough that its matmuls dominate
    (`BF16_MIN_WIDTH`); float32 elsewhere, and for the tiny demo and test models, which gain nothing while
    float32 keeps their runs exactly reproducible."""
    if str(device).startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if width >= BF16_MIN_WIDTH and native_bf16_cpu() else "float32"


# trainer.microbatch.max_tokens=auto per device. On an H200 (SmolLM2-135M's shape, 64 rows of ~250 tokens) a
# forward and backward took 2.32 s in micro-batches of 1,024 tokens (16; 107k kernel launches) and 0.61 s in
# one of 16,384: a GPU pays per launch, where a CPU's matmuls are already large enough at 1,024.
AUTO_BUDGET = {"cpu": 1024, "cuda": 16384}


def token_budget(max_tokens: int | str, device: str) -> int:
    """trainer.microbatch.max_tokens with auto made explicit for the trainer's `device` (`AUTO_BUDGET`)."""
    if max_tokens != "auto":  # schemas.config.AUTO (this module stays free of the config's imports)
        return int(max_tokens)
    return AUTO_BUDGET["cuda" if str(device).startswith("cuda") else "cpu"]
