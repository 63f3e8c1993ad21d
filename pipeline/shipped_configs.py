"""The configs shipped in pipeline/configs/, named on the command line: `asyncrl run chain`."""

from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).parent / "configs"  # pipeline/configs/<name>.yaml: `asyncrl run <name>`


def config_file(given: str | None) -> str:
    """A YAML path, or the name of a shipped config (`arith`, `chain`); none given = `arith`, the demo."""
    from pipeline.config import ConfigError

    if given is None:
        return str(SHIPPED / "arith.yaml")
    if Path(given).is_file() or given.endswith((".yaml", ".yml")):
        return given
    if (SHIPPED / f"{given}.yaml").is_file():
        return str(SHIPPED / f"{given}.yaml")
    names = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.yaml")))
    raise ConfigError(f"{given!r} is neither a config file nor a shipped config ({names})")
