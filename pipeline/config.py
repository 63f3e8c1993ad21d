"""Load a RunConfig from YAML plus dotted `key=value` overrides, with clear errors; `resolve` it.

What an older config wrote (a renamed field, 0 or null for an automatic value, the launcher's state) is a
one-line error saying what to write now, before anything starts.
"""

from __future__ import annotations

import importlib
import re
import typing
from pathlib import Path
from typing import Any

import msgspec
import yaml
from msgspec.structs import replace

from pipeline.model_cache import model_path, model_width
from schemas.config import AUTO, RunConfig
from schemas.errors import ConfigError
from workers.cores import auto_dtype, cores_here, split_cores, token_budget


def parse_override(text: str) -> tuple[list[str], Any]:
    """'trainer.optim.lr=1e-4' -> (['trainer', 'optim', 'lr'], 0.0001); values are parsed as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    return key.split("."), value


# Names that older configs used, and what to write now: fields renamed on the way into a section. A field that
# only moved into a section (trainer.lr is trainer.optim.lr) is found by its name (`moved_to`).
RENAMED = {
    "trainer.microbatch": "trainer.microbatch.mode",  # a string then: a section now
    "trainer.max_tokens_per_microbatch": "trainer.microbatch.max_tokens",
    "trainer.min_microbatches": "trainer.microbatch.min_count",
    "trainer.microbatches_fixed": "trainer.microbatch.fixed_count",
    "trainer.loss_aggregation": "trainer.loss.aggregation",
    "trainer.checkpoint_every": "trainer.checkpoint.every",
    "trainer.keep_checkpoints": "trainer.checkpoint.keep",
    "trainer.warmup_steps": "model.warmup_steps",
    "rollout.recompute_cache": "rollout.cache_lag (recompute_cache true is cache_lag 0, false a large cache_lag)",
}


# What older configs wrote for an automatic value, which is spelled "auto" (a 0 elsewhere is a real zero).
OLD_AUTOMATIC: dict[str, Any] = {
    "broker.fetch_wait_ms": 0,
    "model.warmup_steps": None,
    "data.eval_source": "",
    "rollout.max_new_tokens": 0,
    "rollout.cache_lag": None,
    "rollout.threads": 0,
    "trainer.threads": 0,
    "trainer.loss.clip_eps_high": 0,
    "trainer.checkpoint.weights_dir": "",
}


# The launcher's state that older configs set, and why a config cannot (the launcher writes `launcher`).
LAUNCHER_OWNED = {
    "cores": "`asyncrl run` shares its CPU affinity (start it under taskset for fewer, or set the threads)",
    "broker.embedded": "`asyncrl run` sets it when it starts the broker; `asyncrl prepare --embedded-broker` says it",
    "broker.sole_consumers": "true under `asyncrl run`, which starts every worker; false in a deployment",
}


def set_path(tree: dict[str, Any], path: list[str], value: Any, what: str) -> None:
    """tree[path[0]][path[1]]... = value, creating sections; `what` names the setting in errors."""
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{what}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Each `section.key=value` into `tree`."""
    for text in overrides:
        path, value = parse_override(text)
        set_path(tree, path, value, f"override {text!r}")
    return tree


def field_paths(struct: type[msgspec.Struct] = RunConfig, prefix: str = "") -> dict[str, type | None]:
    """Every field of the schema by dotted name, with its section's type (None for a value)."""
    paths: dict[str, type | None] = {}
    for field in msgspec.structs.fields(struct):
        name = f"{prefix}{field.name}"
        section = field.type if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct) else None
        paths[name] = section
        if section is not None:
            paths.update(field_paths(section, f"{name}."))
    return paths


def moved_to(old: str) -> str | None:
    """Where a name that is no field of the schema lives now: its renamed field, or the one field of that name
    in a section below its own."""
    if old in RENAMED:
        return RENAMED[old]
    parent, _, leaf = old.rpartition(".")
    below = [path for path in field_paths() if path.startswith(f"{parent}.") and path.endswith(f".{leaf}")]
    return below[0] if len(below) == 1 and below[0] != old else None


def check_names(tree: dict[str, Any], where: str) -> None:
    """A name or an automatic value of an older config (an unknown field, a section given a value, a 0 that
    meant auto) is one line naming what to write now."""
    schema = field_paths()

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            section = schema.get(name, False)  # False: no field of that name
            if name == "launcher":
                raise ConfigError("launcher is what a launcher writes into a run's config.yaml, never an override")
            if name in LAUNCHER_OWNED:
                raise ConfigError(f"{name} is the launcher's, not a config's{where}: {LAUNCHER_OWNED[name]}")
            if section and isinstance(value, dict):
                walk(value, f"{name}.")
            elif section is None:  # a value's field
                if name in OLD_AUTOMATIC and old_automatic(value, OLD_AUTOMATIC[name]):
                    raise ConfigError(f"{name}={yaml_scalar(value)}: an automatic value is spelled {name}=auto{where}")
            elif (new := moved_to(name)) is not None:  # no such field, or a section given a value
                raise ConfigError(f"{name} was renamed: use {new}{where}")

    walk(tree, "")


def old_automatic(value: Any, spelling: Any) -> bool:
    """`value` is `spelling` (0, null or ''), a boolean never (False == 0)."""
    return not isinstance(value, bool) and type(value) in (type(spelling), float) and value == spelling


def yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_style=None).removesuffix("\n...\n").strip()


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """The config as written: defaults, then the YAML file, then the overrides (`resolve` fills in the rest).
    A file's `launcher` section is what a launcher wrote into a run's config.yaml (`on_one_machine` and
    `prepare` write it anew); an override cannot set it."""
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
    launcher = tree.pop("launcher", None)
    check_names(tree, f" (in {path})")
    tree = apply_overrides(tree, list(overrides))
    check_names(tree, "")
    if launcher is not None:
        tree["launcher"] = launcher
    try:
        config = msgspec.convert(tree, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config{origin(exc, path, list(overrides))}: {exc}") from exc
    return config


def origin(error: msgspec.ValidationError, path: str | Path | None, overrides: list[str]) -> str:
    """Where the invalid value came from: the last override that set its field (msgspec names it, as
    `$.section.key[0]`), else the file."""
    field = re.search(r"at `\$\.([^`]*)`", str(error))
    name = re.sub(r"\[\d+\]", "", field.group(1)) if field else ""
    for text in reversed(overrides):
        key = ".".join(parse_override(text)[0])  # parsed once already: it cannot fail here
        if name == key or name.startswith(f"{key}."):
            return f" (override {text!r})"
    return f" in {path}" if path else ""


def resolve(config: RunConfig) -> RunConfig:
    """Every automatic value ("auto") made explicit, so config.yaml and `--dry-run` say what runs. Idempotent.

    Called where a config is handed to workers (`prepare`, which writes config.yaml; `asyncrl worker`)
    or shown (`--dry-run`), once the run directory is named. The field descriptions say what each becomes.
    """
    broker, data, trainer, model, rollout = config.broker, config.data, config.trainer, config.model, config.rollout
    task = load_task_or_error(data.task)
    if rollout.workflow:
        load_or_error(rollout.workflow, "workers.rollout.workflow", "load_workflow")
    if rollout.max_new_tokens == AUTO:
        rollout = replace(rollout, max_new_tokens=task.max_new_tokens)
    if rollout.cache_lag == AUTO:
        rollout = replace(rollout, cache_lag=0 if rollout.backend == "vllm" else 1)
    model = replace(model, path=model_path(model.path))  # an imported model's short name: its directory
    if model.warmup_steps == AUTO:
        model = replace(model, warmup_steps=task.demo.warmup_max_steps)
    if model.dtype == AUTO:
        model = replace(model, dtype=auto_dtype(model.device, model_width(model.path) if model.path else 0))
    data = replace(data, eval_source=data.eval_source_or_default())
    if broker.fetch_wait_ms == AUTO:
        broker = replace(broker, fetch_wait_ms=20 if trainer.max_staleness == 0 else 50)
    if AUTO in (trainer.threads, rollout.threads):
        trainer_threads, rollout_threads = threads_on(config.launcher.cores, config)
        trainer, rollout = replace(trainer, threads=trainer_threads), replace(rollout, threads=rollout_threads)
    if trainer.loss.clip_eps_high == AUTO:
        trainer = replace(trainer, loss=replace(trainer.loss, clip_eps_high=trainer.loss.clip_eps))
    if trainer.microbatch.max_tokens == AUTO:
        budget = token_budget(AUTO, model.device)
        trainer = replace(trainer, microbatch=replace(trainer.microbatch, max_tokens=budget))
    if trainer.checkpoint.weights_dir == AUTO:
        trainer = replace(trainer, checkpoint=replace(trainer.checkpoint, weights_dir=derived_weights_dir(config)))
    return replace(config, broker=broker, data=data, trainer=trainer, model=model, rollout=rollout)


def threads_on(cores: int, config: RunConfig) -> tuple[int, int]:
    """(trainer threads per rank, rollout threads per worker): those given, the automatic ones split from `cores`
    (0, a deployment where each replica's cores are unknown here: 1 each)."""
    trainer, rollout = config.trainer, config.rollout
    given = [0 if threads == AUTO else threads for threads in (trainer.threads, rollout.threads)]
    if not cores:
        return given[0] or 1, given[1] or 1
    return split_cores(cores, trainer.ranks, rollout.workers, *given)


def derived_weights_dir(config: RunConfig) -> str:
    """Where `resolve` puts a run's weights when the config names no place: <runs_dir>/<name>/weights, absolute."""
    return str((Path(config.runs_dir) / config.name / "weights").resolve())


def on_one_machine(config: RunConfig) -> RunConfig:
    """`asyncrl run`: every worker on the launcher's machine, sharing its cores, and started by the launcher
    alone, so a role's only worker need not join its consumer group; no broker.bootstrap: the launcher starts
    the embedded broker (a resumed run's config.yaml names the one it started)."""
    embedded = config.launcher.embedded_broker or not config.broker.bootstrap
    launcher = replace(config.launcher, cores=cores_here(), embedded_broker=embedded, sole_consumers=True)
    return replace(config, launcher=launcher)


def load_task_or_error(spec: str):
    """The configured task (workers.tasks), or a ConfigError saying why it cannot be loaded."""
    return load_or_error(spec, "workers.tasks", "load_task")


def load_or_error(spec: str, module: str, loader: str):
    """`module.loader(spec)` (a plug-in by name), or a ConfigError saying why it cannot be loaded; the module is
    imported only here, so that the launcher's start stays light."""
    try:
        return getattr(importlib.import_module(module), loader)(spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def to_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False)


def save_config(config: RunConfig, path: Path) -> None:
    path.write_text(to_yaml(config))


RUN_DIR_NOTE = "# asyncrl run names the run directory <name>-<time>: paths below under <name> get that name\n"


class FieldDoc(typing.NamedTuple):
    """One leaf field of a config: its dotted name, value, type (constraints stripped) and description."""

    name: str
    value: Any
    type: Any
    description: str


def config_fields(config: msgspec.Struct, prefix: str = "") -> typing.Iterator[FieldDoc]:
    """Every leaf field of `config`, sections walked in declaration order (`--explain`, the docs' reference)."""
    hints = typing.get_type_hints(type(config), include_extras=True)
    for field in msgspec.structs.fields(config):
        name, value = f"{prefix}{field.name}", getattr(config, field.name)
        if isinstance(value, msgspec.Struct):
            yield from config_fields(value, f"{name}.")
            continue
        hint = hints[field.name]
        metas = getattr(hint, "__metadata__", ())
        description = next((m.description for m in metas if isinstance(m, msgspec.Meta)), "")
        yield FieldDoc(name, value, getattr(hint, "__origin__", hint) if metas else hint, description)


def explain(config: RunConfig) -> str:
    """Every field of `config` with its value and description, one per line."""
    return "".join(f"{f.name} = {f.value!r}  # {f.description}\n" for f in config_fields(config))
