"""What a finished run's topics say about it: every group released was trained whole or dropped with a
reason, no trajectory was trained twice, steps and versions ran 1..N without a gap or a repeat.

Read from the run's `topics.export` (what the launcher writes when it stops the embedded broker), so the verdict
is the run's own record, not anything a worker reported about itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from schemas.messages import BatchManifest, DeadLetter, PromptGroup, Scored, WeightVersion, split_trajectory_id
from topics.export import TopicsExport, load_export
from topics.transport import M, RawRecord, decode_or_error
from workers.announce import signature_problem


@dataclass
class Audit:
    released: int = 0
    trained_groups: int = 0
    dropped_groups: int = 0
    lost: list[str] = field(default_factory=list)  # prompt ids released, neither trained whole nor dropped
    duplicated: list[str] = field(default_factory=list)  # trajectory ids trained more than once
    problems: list[str] = field(default_factory=list)  # steps, versions, manifests: each in words

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.problems)


def order_problems(trainer_lines: list[dict]) -> list[str]:
    """Steps that trained groups released at a later version than their own: a step trained out of its order (a
    restarted trainer's redo), which the topics alone do not show (each manifest still names its own step)."""
    return [
        f"step {line['step']} trained groups released {-line['staleness_max']} versions after its own"
        for line in trainer_lines
        if line.get("staleness_max", 0) < 0
    ]


def decoded(export: TopicsExport, role: str, cls: type[M]) -> list[tuple[RawRecord, M]]:
    """The records of `role` that decode as `cls`, each with its record; poison is left out."""
    found = []
    for record in export.records.get(role, []):
        message = decode_or_error(record.value, cls)
        if isinstance(message, cls):
            found.append((record, message))
    return found


def audit_export(path: Path, steps: int, key: bytes | None) -> Audit:
    """The verdict on the run whose topics were exported to `path`, which was to make `steps` steps; `key` is
    the run's (`run.key`): only announcements its trainer signed count as versions."""
    export = load_export(path)
    releases = released_groups(export)
    manifests = [m for _, m in decoded(export, "batches", BatchManifest)]
    scored = {(r.partition, r.offset): m for r, m in decoded(export, "scored", Scored)}
    announced = decoded(export, "weights", WeightVersion)
    versions = [m for r, m in announced if signature_problem(key, m, r.headers) is None]
    result = Audit(released=len({g.prompt_id for g in releases}))
    times = Counter(g.prompt_id for g in releases)
    result.problems += [f"prompt {pid!r} released {n} times" for pid, n in times.items() if n > 1]
    trained = Counter(t for m in manifests for t in m.trajectory_ids)
    result.duplicated = sorted(t for t, n in trained.items() if n > 1)
    result.problems += manifest_problems(manifests, scored) + step_problems(manifests, versions, steps)
    fate_of_groups(result, releases, manifests, set(trained))
    return result


def released_groups(export: TopicsExport) -> list[PromptGroup]:
    """The records on `prompts` the trainer took as releases: one it dead-lettered (outside the model, or
    contradicting an earlier release of its group) was not the prompt source's, and nothing waited for it."""
    refused = {
        (letter.partition, letter.offset)
        for _, letter in decoded(export, "dead-letter", DeadLetter)
        if letter.origin.startswith("trainer") and letter.source.endswith("prompts")
    }
    return [m for r, m in decoded(export, "prompts", PromptGroup) if (r.partition, r.offset) not in refused]


def fate_of_groups(
    result: Audit, releases: list[PromptGroup], manifests: list[BatchManifest], trained: set[str]
) -> None:
    """Each released group: trained whole (every sample index), or dropped with a reason; anything else is lost."""
    samples: dict[str, set[int]] = {}
    for trajectory in trained:
        prompt_id, index = split_trajectory_id(trajectory)
        samples.setdefault(prompt_id, set()).add(index)
    dropped = {d.prompt_id for m in manifests for d in m.dropped if d.reason}
    sizes = {g.prompt_id: g.n_samples for g in releases}
    whole = {pid for pid, got in samples.items() if pid in sizes and got == set(range(sizes[pid]))}
    result.trained_groups, result.dropped_groups = len(whole), len(dropped & set(sizes))
    result.lost = sorted(set(sizes) - whole - dropped)
    result.problems += [f"group {pid!r} trained but never released" for pid in sorted(set(samples) - set(sizes))]


def manifest_problems(manifests: list[BatchManifest], scored: dict[tuple[int, int], Scored]) -> list[str]:
    """Every manifest names the `scored` record of each of its trajectories."""
    problems = []
    for manifest in manifests:
        for trajectory, where in zip(manifest.trajectory_ids, manifest.scored_offsets, strict=True):
            record = scored.get(tuple(where))
            if record is None or record.trajectory_id != trajectory:
                problems.append(f"step {manifest.step}: {trajectory!r} is not the scored record at {tuple(where)}")
    return problems


def step_problems(manifests: list[BatchManifest], versions: list[WeightVersion], steps: int) -> list[str]:
    """Manifests for steps 1..N, once each, each from version step - 1; versions 0..N announced, N as final."""
    problems = []
    found = sorted(m.step for m in manifests)
    if found != list(range(1, steps + 1)):
        repeated = sorted(s for s, n in Counter(found).items() if n > 1)
        missing = sorted(set(range(1, steps + 1)) - set(found))
        problems.append(f"manifest steps are not 1..{steps}: repeated {repeated}, missing {missing[:10]}")
    problems += [
        f"step {m.step} trained from version {m.trainer_version}" for m in manifests if m.trainer_version != m.step - 1
    ]
    announced = {w.version for w in versions}
    if announced != set(range(steps + 1)):
        problems.append(
            f"versions announced are not 0..{steps}: missing {sorted(set(range(steps + 1)) - announced)[:10]}"
        )
    if not any(w.final and w.version == steps for w in versions):
        problems.append(f"no final announcement of version {steps}")
    return problems
