"""A run's directory: every run gets its own, even one started from another run's config.yaml."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import load_config, resolve
from pipeline.launch import new_run_dir
from workers import runtime


def test_another_run_s_config_run_again_writes_its_weights_in_its_own_directory(tmp_path: Path) -> None:
    first = resolve(load_config(None, [f"runs_dir={tmp_path}", "name=a"]))  # as its config.yaml has it
    again = resolve(new_run_dir(first))
    assert runtime.weights_dir(again) == runtime.run_dir(again) / "weights"
    assert runtime.weights_dir(again) != runtime.weights_dir(first)


def test_a_weights_directory_of_the_user_s_choice_is_kept(tmp_path: Path) -> None:
    shared = tmp_path / "shared-storage"
    chosen = resolve(load_config(None, [f"runs_dir={tmp_path}", "name=b", f"trainer.checkpoint.weights_dir={shared}"]))
    assert runtime.weights_dir(resolve(new_run_dir(chosen))) == shared
