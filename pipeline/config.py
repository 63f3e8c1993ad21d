"""Load a RunConfig from YAML plus dotted `key=value` overrides, with clear errors."""

from __future__ import annotations

from pathlib import Path
import typing
from typing import Any

import msgspec
import yaml

from schemas.config import RunConfig


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says where and why."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """'trainer.lr=1e-4' -> (['trainer', 'lr'], 0.0001); values are parsed as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    return key.split("."), value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return tree


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """The resolved config: defaults, then the YAML file, then the overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        tree = loaded or {}
    tree = apply_overrides(tree, list(overrides))
    try:
        return msgspec.convert(tree, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid config{where}: {exc}") from exc


def to_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False)


def save_config(config: RunConfig, path: Path) -> None:
    path.write_text(to_yaml(config))


def explain() -> str:
    """Every field with its type, default and description, one per line."""
    lines: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls, include_extras=True)
        for field in msgspec.structs.fields(cls):
            name = f"{prefix}{field.name}"
            if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
                walk(field.type, f"{name}.")
                continue
            metas = getattr(hints[field.name], "__metadata__", ())
            description = next((m.description for m in metas if isinstance(m, msgspec.Meta)), "")
            lines.append(f"{name} = {field.default!r}  # {description}")

    walk(RunConfig, "")
    return "\n".join(lines)
