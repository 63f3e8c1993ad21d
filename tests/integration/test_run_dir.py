"""A run's directory: every run gets its own, even one started from another run's config.yaml, and one
launcher at a time runs it (a second one is refused; an earlier one's workers are waited for)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config, resolve
from pipeline.launch.resume import run_dir_lock, wait_for_earlier_launch
from pipeline.launch.run_dir import new_run_dir
from workers import runtime

HOLD_LOCK = """
import fcntl, sys, time
lock = open(sys.argv[1], "a+")
fcntl.flock(lock, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_another_run_s_config_run_again_writes_its_weights_in_its_own_directory(tmp_path: Path) -> None:
    first = resolve(load_config(None, [f"runs_dir={tmp_path}", "name=a"]))  # as its config.yaml has it
    again = resolve(new_run_dir(first))
    assert runtime.weights_dir(again) == runtime.run_dir(again) / "weights"
    assert runtime.weights_dir(again) != runtime.weights_dir(first)


def test_a_weights_directory_of_the_user_s_choice_is_kept(tmp_path: Path) -> None:
    shared = tmp_path / "shared-storage"
    chosen = resolve(load_config(None, [f"runs_dir={tmp_path}", "name=b", f"trainer.checkpoint.weights_dir={shared}"]))
    assert runtime.weights_dir(resolve(new_run_dir(chosen))) == shared
    shared.mkdir()
    for version in (3, 12):
        runtime.version_path(shared, version).write_bytes(b"weights")  # as a run there writes them
    with pytest.raises(ConfigError) as refused:
        new_run_dir(chosen)
    assert str(refused.value) == (
        f"trainer.checkpoint.weights_dir {shared} holds weight versions already (v3 to v12, another run's): "
        "give this run an empty directory"
    )


def test_a_second_launcher_of_a_run_is_refused_in_one_line_until_the_first_has_ended(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "launcher.lock")], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        (tmp_path / "launcher.lock").write_text(f"{holder.pid}\n")  # as the launcher holding it writes it
        with pytest.raises(ConfigError) as refused, run_dir_lock(tmp_path):
            pass
        assert str(refused.value) == (
            f"{tmp_path} is being run by another launcher (pid {holder.pid}): stop it first (Ctrl-C or SIGTERM)"
        )
    finally:
        holder.kill()
        holder.wait()
    with run_dir_lock(tmp_path):  # the kernel let go of it with the process
        assert (tmp_path / "launcher.lock").read_text() == f"{os.getpid()}\n"


def test_a_resume_waits_for_the_workers_of_the_run_s_earlier_launch(tmp_path: Path, capsys) -> None:
    """A worker names the run's config.yaml on its command line; a killed launcher's workers end by themselves."""
    config = str(tmp_path / "config.yaml")
    ending = sleeper(1.5, config)
    lingering = sleeper(60, config + ".other")
    try:
        wait_for_earlier_launch(tmp_path, timeout_s=30)
        assert ending.poll() == 0  # waited for it, not for the other run's
        assert capsys.readouterr().err == f"asyncrl: waiting for the run's earlier launch to end (pids {ending.pid})\n"
        stuck = sleeper(60, config)
        try:
            with pytest.raises(
                ConfigError, match=rf"processes of its earlier launch still run after 1 s \(pids {stuck.pid}\)"
            ):
                wait_for_earlier_launch(tmp_path, timeout_s=1)
        finally:
            stuck.kill()
            stuck.wait()
    finally:
        lingering.kill()
        lingering.wait()


def sleeper(seconds: float, config: str) -> subprocess.Popen:
    """A process naming `config` as a worker does, returned once its command line shows it (after its exec)."""
    process = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})", "--config", config])
    while config.encode() not in Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0"):
        time.sleep(0.01)
    return process
