"""The W&B settings checked before anything starts (the stream into a real W&B run: tests/integration)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import ConfigError, load_config


def test_wandb_settings_are_checked_with_the_config() -> None:
    with pytest.raises(ConfigError, match=r"need telemetry\.wandb_project"):
        load_config(None, ["telemetry.wandb_mode=offline"])
    with pytest.raises(ConfigError, match="W&B forbids"):
        load_config(None, ["telemetry.wandb_project=team/project"])


def test_a_project_without_wandb_installed_stops_the_run_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an install without the extra finds
    assert main(["run", f"runs_dir={tmp_path}", "telemetry.wandb_project=asyncrl-test", "--no-progress"]) == 2
    assert "wandb is not installed: pip install 'asyncrl[wandb]'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no run directory, no broker, no model
