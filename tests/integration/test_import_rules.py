"""The import rules of pyproject.toml's [tool.importlinter], which `make lint` checks with `lint-imports`: each one
catches a deliberate violation in a copy of the four packages, and the packages as they are keep every one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "topics", "workers", "pipeline")


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The four packages and pyproject.toml, as the repository holds them now."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` in `root`, on the packages there (not the installed ones)."""
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [command, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def add_module(root: Path, name: str, source: str) -> None:
    (root / Path(*name.split("."))).with_suffix(".py").write_text(source)


def test_the_packages_keep_every_import_rule(copy: Path) -> None:
    done = lint_imports(copy)
    assert done.returncode == 0, done.stdout + done.stderr


def test_workers_importing_pipeline_breaks_the_layers(copy: Path) -> None:
    add_module(copy, "workers.back_arrow", "from pipeline import cli\n")
    done = lint_imports(copy)
    assert done.returncode == 1
    assert "pipeline > workers > topics > schemas BROKEN" in done.stdout
    assert "workers.back_arrow -> pipeline.cli" in done.stdout


def test_two_modules_importing_each_other_is_a_circle(copy: Path) -> None:
    add_module(copy, "pipeline.circle_a", "def a() -> None:\n    from pipeline import circle_b  # in a function too\n")
    add_module(copy, "pipeline.circle_b", "import pipeline.circle_a\n")
    done = lint_imports(copy)
    assert done.returncode == 1
    assert "No import circles between the modules of a package BROKEN" in done.stdout
    assert "No cycles are allowed in pipeline." in done.stdout
    assert ".circle_a -> .circle_b" in done.stdout or ".circle_b -> .circle_a" in done.stdout


def test_aiokafka_outside_topics_is_forbidden(copy: Path) -> None:
    add_module(copy, "workers.kafka_client", "from aiokafka.errors import KafkaError\n")
    done = lint_imports(copy)
    assert done.returncode == 1
    assert "Only topics knows Kafka: aiokafka (or kafka) imported nowhere else BROKEN" in done.stdout
    assert "workers.kafka_client -> aiokafka" in done.stdout
