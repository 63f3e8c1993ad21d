"""Memory a worker thread freed goes back to the OS once `release_freed_memory` runs (Linux, glibc)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from workers.runtime import LIBC, release_freed_memory


def resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not hasattr(LIBC, "malloc_trim"), reason="malloc_trim is glibc's: nothing to release elsewhere")
def test_what_a_thread_freed_is_handed_back():
    def churn() -> None:  # 400 MB in 64 kB tensors: below glibc's mmap threshold, so kept in the thread's arena
        held = [torch.ones(16_384) for _ in range(6_400)]
        del held

    worker = threading.Thread(target=churn)
    worker.start()
    worker.join()
    before = resident_mb()
    release_freed_memory()
    assert before - resident_mb() > 200, (before, resident_mb())
