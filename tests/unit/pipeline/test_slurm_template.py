"""The Slurm job template ships as package data: `asyncrl slurm submit` finds it in a wheel and the image too."""

from __future__ import annotations

import importlib.resources
import tomllib
from pathlib import Path, PurePosixPath

from pipeline import slurm

ROOT = Path(__file__).resolve().parents[3]
# the names render() passes to JobTemplate.substitute
FIELDS = {
    "sbatch_options",
    "python",
    "run_dir",
    "bootstrap",
    "broker_port",
    "no_gpu",
    "prepare_arguments",
    "worker_steps",
}


def test_the_template_is_a_resource_of_the_pipeline_package():
    template = importlib.resources.files("pipeline").joinpath("templates", "pipeline.sbatch")
    assert template.is_file()
    assert template == slurm.TEMPLATE
    assert template.read_text(encoding="utf-8").startswith("#!/bin/bash\n")


def test_the_template_fills_in_exactly_what_render_passes():
    text = slurm.TEMPLATE.read_text(encoding="utf-8")
    job = slurm.JobTemplate(text)
    assert job.is_valid() and set(job.get_identifiers()) == FIELDS


def test_package_data_declares_the_template():
    """What setuptools puts in the wheel: a glob of [tool.setuptools.package-data] must match the file."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        package_data = tomllib.load(file)["tool"]["setuptools"]["package-data"]["pipeline"]
    assert any(PurePosixPath("templates/pipeline.sbatch").match(pattern) for pattern in package_data)
    assert not (ROOT / "infra" / "slurm").exists()  # one copy of the template, inside the package
