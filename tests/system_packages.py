"""Debian packages a test needs (bubblewrap, Slurm, Docker), installed with apt-get when missing, as a user
would; a failed install fails the test with apt's words, it never passes silently."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

import pytest


def apt_install(packages: list[str], installed: Callable[[], bool]) -> None:
    """Install `packages` unless `installed()`; pytest.fail with the end of apt's output if it does not work."""
    if installed():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    try:
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:  # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"could not install {' '.join(packages)} ({' '.join(install)}): {exc}")
    if done.returncode != 0 or not installed():
        pytest.fail(
            f"could not install {' '.join(packages)} ({' '.join(install)}):\n{(done.stdout + done.stderr)[-2000:]}"
        )
