"""The poison harness: a short arith run on a JSONL dataset with bad rows among the good ones, poison produced
onto every topic its workers read while they work, then the run read back from its own topics.

It passes when no worker crashed (one process per role, no restart), the trainer's metrics stayed finite, every
poisoned record and every bad row is on `dead-letter` from each worker that reads it (with a reason), the run
finished with every group trained or dropped, and its held-out accuracy is within `tolerance` of a clean run of
the same config and the same good rows.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from pipeline.chaos.audit import audit_export
from pipeline.chaos.kills import left_behind
from pipeline.chaos.poison import Poison, RunView, randomised, table
from pipeline.chaos.rows import task_rows, write_dataset, write_rows
from pipeline.chaos.runs import Launch, RunStalled, summary_of
from schemas.messages import DeadLetter, PromptGroup, WeightVersion
from topics.clients import make_producer
from topics.export import load_export
from topics.names import TopicLayout
from topics.readers import read_topic
from topics.transport import decode_or_error
from workers.announce import load_key

ROLES = ("prompts", "rollout", "reward", "trainer")
SECOND_HALF_S = 30.0  # the second half of the random records: at a third of the steps, or this long after the first


@dataclass(frozen=True)
class PoisonSettings:
    out: Path
    steps: int = 120
    batch_groups: int = 8
    n_samples: int = 8
    messages: int = 10_000  # randomised records, besides one of each kind of the table
    bad_rows: int = 300
    eval_rows: int = 200
    warm: bool = True  # warm the demo model up, so that accuracy has somewhere to go
    clean: bool = True  # also run the same config on the good rows alone: the accuracy to compare with
    tolerance: float = 0.10
    seed: int = 0
    timeout_s: float = 900.0
    overrides: tuple[str, ...] = ()
    skip_kinds: tuple[str, ...] = ()  # kinds of the table left out (by a part of their name)


@dataclass(frozen=True)
class Inputs:
    model: Path
    clean: Path  # the good rows
    poisoned: Path  # the same good rows, in the same order, with bad rows among them
    held_out: Path
    bad_lines: dict[int, str]  # line -> kind of bad row


@dataclass(frozen=True)
class Produced:
    poison: Poison
    partition: int
    offset: int


def prepare_inputs(settings: PoisonSettings) -> Inputs:
    """The demo model (built once per output directory) and the three JSONL files."""
    from pipeline.demo_model import build_model, build_tokenizer, prepare_demo_model

    work = settings.out / "inputs"
    model = work / ("model-warm" if settings.warm else "model-untrained")
    if not (model / "config.json").exists():
        if settings.warm:
            prepare_demo_model(model, "arith", seed=settings.seed, task_seed=settings.seed, progress=False)
        else:
            build_model(model, build_tokenizer(model), seed=settings.seed)
    train, held_out = task_rows(settings.seed, 200)
    rng = random.Random(settings.seed)
    bad_lines = write_dataset(work / "poisoned.jsonl", train, settings.bad_rows, rng)
    return Inputs(
        model, write_rows(work / "clean.jsonl", train), work / "poisoned.jsonl",
        write_rows(work / "held-out.jsonl", held_out), bad_lines,
    )  # fmt: skip


def run_args(settings: PoisonSettings, inputs: Inputs, dataset: Path) -> list[str]:
    """The arith demo's config on `dataset`, short; math-verify scores (a dataset file has no built-in verifier)."""
    return [
        f"model.path={inputs.model}", f"data.source={dataset}", f"data.eval_source={inputs.held_out}",
        "data.reward=math", f"trainer.steps={settings.steps}", f"trainer.batch_groups={settings.batch_groups}",
        f"data.n_samples={settings.n_samples}", "eval.every=0", f"eval.max_rows={settings.eval_rows}",
        f"seed={settings.seed}", f"max_wall_s={settings.timeout_s - 60}", *settings.overrides,
    ]  # fmt: skip


def all_started(launch: Launch) -> bool:
    """Every worker has logged its start: the poison meets workers at work, not a topic nobody reads yet."""
    pids = {role: launch.role_pid(role) for role in ROLES}
    return all(pid is not None and launch.worker_started(role, pid) for role, pid in pids.items())


async def newest(bootstrap: str, layout: TopicLayout) -> tuple[PromptGroup, WeightVersion]:
    """The run's newest released group and weight version, once it has both."""
    for _ in range(300):
        groups = [r.message for r in await read_topic(bootstrap, layout.name("prompts"), PromptGroup)]
        versions = [r.message for r in await read_topic(bootstrap, layout.name("weights"), WeightVersion)]
        groups = [g for g in groups if isinstance(g, PromptGroup)]
        versions = [v for v in versions if isinstance(v, WeightVersion)]
        if groups and versions:
            return max(groups, key=lambda g: g.release_index), max(versions, key=lambda v: v.version)
        await asyncio.sleep(0.2)
    raise RunStalled("no released group or weight version within 60 s")


def look(bootstrap: str, layout: TopicLayout, inputs: Inputs, work: Path) -> RunView:
    """What poison is cut from: the newest group and version, a corrupted copy of that version's file."""
    from transformers import AutoConfig

    group, version = asyncio.run(newest(bootstrap, layout))
    data = bytearray(Path(version.uri).read_bytes())
    data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)  # same size, half of it zeros: the hash differs
    corrupt = work / "corrupt.safetensors"
    corrupt.write_bytes(bytes(data))
    vocab = AutoConfig.from_pretrained(inputs.model).get_text_config().vocab_size
    return RunView(group, vocab, version.uri, version.content_hash, str(corrupt))


async def produce(bootstrap: str, layout: TopicLayout, poisons: list[Poison]) -> list[Produced]:
    """Every record queued, then every delivery awaited: where each one landed."""
    async with make_producer(bootstrap, linger_ms=5) as producer:
        pending = [
            await producer.send(layout.name(p.role), p.value, key=b"chaos", headers=list(p.headers)) for p in poisons
        ]
        landed = [await delivery for delivery in pending]
    return [Produced(p, meta.partition, meta.offset) for p, meta in zip(poisons, landed, strict=True)]


def poisoned_run(settings: PoisonSettings, inputs: Inputs, rng: random.Random) -> dict:
    """The run on the poisoned rows; the table and half the random records once every worker has started, the
    other half a third of the way through (or SECOND_HALF_S later: a run that poison stalled still gets them all);
    then the verdict on what the run recorded."""
    launch, started = Launch(settings.out / "poisoned", run_args(settings, inputs, inputs.poisoned)), time.monotonic()
    produced, still_valid, code, error = [], 0, None, ""
    try:
        if launch.poll_until(lambda: all_started(launch), 300, "every worker started"):
            layout = TopicLayout(yaml.safe_load((launch.run_dir / "config.yaml").read_text())["broker"]["topic_prefix"])
            view = look(launch.bootstrap, layout, inputs, settings.out / "inputs")
            random_records, still_valid = randomised(view, rng, settings.messages)
            half = len(random_records) // 2
            kinds = [p for p in table(view, rng) if not any(skip in p.kind for skip in settings.skip_kinds)]
            produced += asyncio.run(produce(launch.bootstrap, layout, kinds + random_records[:half]))
            later, third = time.monotonic() + SECOND_HALF_S, settings.steps // 3
            if launch.poll_until(lambda: launch.last_step() >= third or time.monotonic() > later, 600, "poison time"):
                produced += asyncio.run(produce(launch.bootstrap, layout, random_records[half:]))
        code = launch.wait(settings.timeout_s)
    except RunStalled as stalled:
        error = f"stalled: {stalled}"
    finally:
        launch.end()  # whatever went wrong here, the run does not outlive the harness
    report = verdict(settings, inputs, launch, produced, code, error)
    report["poison_sent"]["random_still_valid_not_sent"] = still_valid
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def verdict(
    settings: PoisonSettings, inputs: Inputs, launch: Launch, produced: list[Produced], code: int | None, error: str
) -> dict:
    """What the poisoned run recorded, check by check (`checks` says which hold)."""
    leftover = [p.cmdline for p in left_behind(launch)]
    run_dir, summary = launch.run_dir, summary_of(launch.run_dir)
    export_path = run_dir / "topics.export" if run_dir else None
    if export_path is None or not export_path.exists():
        return {"completed": False, "error": error or "no topics.export", "poison_sent": {}, "leftover": leftover}
    layout = TopicLayout(load_export(export_path).header.prefix)
    letters = dead_letters(export_path)
    kinds = Counter(item.poison.kind for item in produced if not item.poison.kind.startswith("random"))
    return {
        "completed": code == 0 and summary.get("outcome") == "finished",
        "exit_code": code,
        "error": error,
        "worker_processes": dict(Counter(path.name.split("-", 1)[0] for path in (run_dir / "logs").glob("*.jsonl"))),
        "restarts": launch.output().count("; restarting it"),
        "non_finite_metrics": non_finite(launch.trainer_lines()),
        "skipped_steps": summary.get("skipped_steps"),
        "poison_sent": {
            "table": sum(kinds.values()),
            "table_kinds": len(kinds),
            "random": len(produced) - sum(kinds.values()),
        },
        "not_dead_lettered": undelivered(produced, letters, layout),
        "letters_without_reason": sum(1 for letter in letters if not letter.reason.strip()),
        "dead_letters_by_reader": dict(Counter(reader_of(letter) for letter in letters)),
        "dead_letters_by_reason": dict(Counter(reason_kind(letter.reason) for letter in letters).most_common()),
        "dataset": dataset_check(letters, str(inputs.poisoned), inputs.bad_lines),
        "audit": asdict(audit_export(export_path, settings.steps, load_key(run_dir))),
        "accuracy": {"base": summary.get("base_accuracy"), "poisoned": summary.get("final_accuracy")},
        "leftover": leftover,
    }


def dead_letters(export_path: Path) -> list[DeadLetter]:
    export = load_export(export_path)
    found = [decode_or_error(record.value, DeadLetter) for record in export.records["dead-letter"]]
    return [letter for letter in found if isinstance(letter, DeadLetter)]


def reader_of(letter: DeadLetter) -> str:
    """The role of the worker that wrote it (a worker id is '<role>-<host>-<pid>')."""
    return letter.origin.split("-", 1)[0]


def undelivered(produced: list[Produced], letters: list[DeadLetter], layout: TopicLayout) -> list[dict]:
    """Each poisoned record that a worker reading its topic did not dead-letter, with the workers missing."""
    got: dict[tuple[str, int, int], set[str]] = {}
    for letter in letters:
        role = layout.role_of(letter.source)
        if role is not None:
            got.setdefault((role, letter.partition, letter.offset), set()).add(reader_of(letter))
    missing = []
    for item in produced:
        lacking = set(item.poison.readers) - got.get((item.poison.role, item.partition, item.offset), set())
        if lacking:
            missing.append({"kind": item.poison.kind, "offset": item.offset, "readers": sorted(lacking)})
    return missing


NUMBERS = re.compile(r"-?\b\d[\d.]*(e[+-]?\d+)?\b|0x[0-9a-f]+")
QUOTED = re.compile(r"'[^']*'|`[^`]*`|\"[^\"]*\"")


def reason_kind(reason: str) -> str:
    """A reason with its numbers and quoted values taken out, so that reasons of one kind count together."""
    return NUMBERS.sub("N", QUOTED.sub("'…'", reason.splitlines()[0] if reason else ""))[:110]


def dataset_check(letters: list[DeadLetter], source: str, bad_lines: dict[int, str]) -> dict:
    """The bad rows dead-lettered by the prompt source with their line numbers, and any good row refused."""
    lines = {letter.offset for letter in letters if letter.source == source and reader_of(letter) == "prompts"}
    return {
        "bad_rows": len(bad_lines),
        "dead_lettered": len(lines & set(bad_lines)),
        "missing": sorted(set(bad_lines) - lines)[:20],
        "good_rows_refused": sorted(lines - set(bad_lines))[:20],
        "by_kind": dict(Counter(bad_lines.values())),
    }


def non_finite(lines: list[dict]) -> int:
    """NaN or inf anywhere in the trainer's metrics lines."""

    def count(value: object) -> int:
        if isinstance(value, float):
            return 0 if math.isfinite(value) else 1
        if isinstance(value, dict):
            return sum(map(count, value.values()))
        return sum(map(count, value)) if isinstance(value, list) else 0

    return sum(map(count, lines))


def clean_run(settings: PoisonSettings, inputs: Inputs) -> dict:
    """The same config on the good rows alone, nothing produced into it: the accuracy to compare with."""
    launch, started = Launch(settings.out / "clean", run_args(settings, inputs, inputs.clean)), time.monotonic()
    code, error = None, ""
    try:
        code = launch.wait(settings.timeout_s)
    except RunStalled as stalled:
        error = f"stalled: {stalled}"
    finally:
        launch.end()
    leftover = [p.cmdline for p in left_behind(launch)]
    run_dir, summary = launch.run_dir, summary_of(launch.run_dir)
    export_path = run_dir / "topics.export" if run_dir else None
    whole = export_path is not None and export_path.exists()
    return {
        "completed": code == 0 and summary.get("outcome") == "finished",
        "error": error,
        "accuracy": {"base": summary.get("base_accuracy"), "final": summary.get("final_accuracy")},
        "dead_letters": len(dead_letters(export_path)) if whole else None,
        "audit": asdict(audit_export(export_path, settings.steps, load_key(run_dir))) if whole else None,
        "leftover": leftover,
        "seconds": round(time.monotonic() - started, 1),
    }


def checks(poisoned: dict, clean: dict | None, tolerance: float) -> dict[str, bool]:
    """Each promise of the poison harness, held or not."""
    audit, dataset, processes = (
        poisoned.get("audit") or {},
        poisoned.get("dataset") or {},
        poisoned.get("worker_processes", {}),
    )
    found = {
        "the run finished": poisoned["completed"],
        "no worker crashed (one process per role, none restarted)": poisoned.get("restarts") == 0
        and processes == dict.fromkeys(ROLES, 1),
        "no NaN or inf in the trainer's metrics": poisoned.get("non_finite_metrics") == 0,
        "every poisoned record dead-lettered by each worker reading its topic (racing kinds: see the audit)": (
            poisoned.get("not_dead_lettered") == []
        ),
        "every dead letter has a reason": poisoned.get("letters_without_reason") == 0,
        "every bad row dead-lettered with its line number, no good row refused": dataset.get("missing") == []
        and dataset.get("good_rows_refused") == [],
        "no group lost, none trained twice, steps and versions 1..N": bool(audit)
        and not (audit["lost"] or audit["duplicated"] or audit["problems"]),
        "no process left behind": not poisoned.get("leftover"),
    }
    if clean is not None:
        clean_accuracy, accuracy = clean["accuracy"]["final"], poisoned.get("accuracy", {}).get("poisoned")
        found["the clean run finished"] = clean["completed"]
        found[f"the poisoned run's held-out accuracy within ±{tolerance * 100:g} points of the clean run's"] = (
            poisoned["completed"]
            and None not in (clean_accuracy, accuracy)
            and abs(accuracy - clean_accuracy) <= tolerance
        )  # a run that poison stopped early is no comparison, whatever its accuracy
    return found


def run_poison(settings: PoisonSettings, progress: bool = False) -> dict:
    """Inputs, the clean run (when asked), the poisoned run, the checks: the whole report."""
    from tqdm import tqdm

    with tqdm(total=3, desc="poison", unit="phase", disable=not progress) as bar:
        bar.set_postfix(phase="model and rows")
        inputs = prepare_inputs(settings)
        bar.update(1)
        bar.set_postfix(phase="clean run")
        clean = clean_run(settings, inputs) if settings.clean else None
        bar.update(1)
        bar.set_postfix(phase="poisoned run")
        poisoned = poisoned_run(settings, inputs, random.Random(settings.seed))
        bar.update(1)
    poisoned["accuracy"]["clean"] = clean["accuracy"]["final"] if clean else None
    return {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
        "bad_rows": len(inputs.bad_lines),
        "clean": clean,
        "poisoned": poisoned,
        "checks": checks(poisoned, clean, settings.tolerance),
    }
