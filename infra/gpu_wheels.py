"""`make gpu-wheels`: cp312 manylinux x86_64 wheels of the pipeline's dependencies that a lent GPU machine lacks,
into infra/gpu-wheels, carried along to it; `asyncrl gpu-check` installs them there (no index) before its checks.

Which requirements are carried is the GPU check's to say (`pipeline.bench.gpu.carried_requirements`); this script
fetches them where PyPI is reachable.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.bench.gpu import (
    ARCHITECTURE,
    NOT_CARRIED,
    REAL_MODEL,
    ROOT,
    WHEELS,
    carried_requirements,
    copy_architecture_files,
)

# downloaded as dependencies, then deleted: torch and transformers install them, and numpy alone is ~15 MiB
BROUGHT_BY_TORCH = ("numpy", "sympy", "mpmath", "setuptools", "pyyaml")
WHEEL_TAGS = [
    "--only-binary=:all:",
    "--python-version=3.12",
    "--implementation=cp",
    "--abi=cp312",
    "--platform=manylinux_2_28_x86_64",
    "--platform=manylinux_2_17_x86_64",
    "--platform=manylinux2014_x86_64",
]


def wheel_name(path: Path) -> str:
    """A wheel file's distribution name, normalised (PyYAML-6.0.3-... -> pyyaml)."""
    from packaging.utils import canonicalize_name

    return canonicalize_name(path.name.split("-")[0])


def download_wheels() -> int:
    """The carried requirements and their dependencies into infra/gpu-wheels, less BROUGHT_BY_TORCH; prints every
    wheel's size, the total and what is left out."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    for old in WHEELS.glob("*.whl"):  # a fresh set: old versions would count in the total and travel for nothing
        old.unlink()
    command = [sys.executable, "-m", "pip", "download", "--quiet", *WHEEL_TAGS, "--dest", str(WHEELS)]
    if (code := subprocess.run([*command, *carried_requirements()]).returncode) != 0:
        return code
    dropped = []
    for wheel in sorted(WHEELS.glob("*.whl")):
        if wheel_name(wheel) in BROUGHT_BY_TORCH:
            dropped.append(f"{wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
            wheel.unlink()
    kept = sorted(WHEELS.glob("*.whl"), key=lambda wheel: wheel.stat().st_size)
    for wheel in kept:
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    total = sum(wheel.stat().st_size for wheel in kept)
    print(f"{total / 2**20:8.2f} MiB in {len(kept)} wheels in {WHEELS.relative_to(ROOT)}")
    print("deleted (torch and transformers install them):", ", ".join(dropped) or "none")
    print("not fetched:", "; ".join(f"{name}: {why}" for name, why in NOT_CARRIED.items()))
    return 0


def copy_architecture() -> None:
    """The imported SmolLM2's config and tokenizer (no weights) into infra/gpu-wheels, for the real-* checks."""
    from pipeline.model_cache import cached_model

    if (source := cached_model(REAL_MODEL)) is None:
        print(f"not copied: the {REAL_MODEL} architecture (`asyncrl model import {REAL_MODEL}` first)")
        return
    copied = copy_architecture_files(source, ARCHITECTURE)
    size = sum(path.stat().st_size for path in copied)
    print(f"{size / 2**20:8.2f} MiB  {ARCHITECTURE.relative_to(ROOT)} (config and tokenizer, {len(copied)} files)")


if __name__ == "__main__":
    code = download_wheels()
    copy_architecture()
    sys.exit(code)
