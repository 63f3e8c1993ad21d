"""Debian packages some tests run for real (bubblewrap, Slurm, Docker). The Makefile installs them (`make
system-deps`, `make compose-test`: root, apt-get); a test never does. Without them a test skips where they cannot be
installed (not Linux, not root, no apt-get) and fails where they could have been, so that a machine able to run it
(CI runs as root) never passes it by skipping."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

SBIN_PATH = os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"  # daemons (slurmctld, dockerd) live there


def require_tools(tools: list[str], packages: list[str], target: str) -> None:
    """Skip or fail the test unless every one of `tools` is on the PATH or in sbin; `make target` installs
    `packages`, which hold them."""
    missing = [name for name in tools if shutil.which(name, path=SBIN_PATH) is None]
    if not missing:
        return
    install = f"`make {target}` installs {' '.join(packages)} with apt-get"
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{' and '.join(missing)} missing; {install}, which needs root on Debian or Ubuntu")
    pytest.fail(f"{' and '.join(missing)} missing: {install}")
