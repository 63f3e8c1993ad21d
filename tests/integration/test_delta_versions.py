"""The offline tools on a run whose trainer published delta versions (trainer.checkpoint.whole_every=3, a tiny
Qwen2 trained by the real `Trainer`): `asyncrl export`, `asyncrl eval --run` and `replay retrain` read a delta
version rebuilt from its chain, bit for bit the trainer's weights at that version; a corrupt delta on the chain
is one line naming the version and the file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from pipeline.cli import main as cli
from pipeline.eval_command import read_checked, run_target
from pipeline.export_model import export_model
from pipeline.retrain import RetrainError, retrain
from schemas.config import RunConfig
from schemas.messages import BatchManifest, Scored
from tests.integration.test_model_families import GROUPS, NEW_TOKENS, run_config, scored_group
from workers import runtime
from workers.prompt_source import INITIAL, Source
from workers.rollout.protocol import SamplingParams
from workers.rollout.worker import make_engine
from workers.rows import load_rows
from workers.trainer.model import Trainer
from workers.weights import WeightsFile

torch.set_num_threads(1)

STEPS = 5  # versions 1 and 3 whole; 2, 4 and 5 deltas


@dataclass
class DeltaRun:
    config: RunConfig
    run_dir: Path
    weights: dict[int, dict[str, torch.Tensor]]  # per version, what the trainer published (model.dtype)
    sha256: dict[int, str]  # per version, the announced whole hash
    manifests: list[BatchManifest]
    scored: dict[tuple[int, int], Scored]


@pytest.fixture(scope="module")
def delta_run(tmp_path_factory: pytest.TempPathFactory) -> DeltaRun:
    """STEPS steps (generate, train, publish, load the announced version), recorded as `batches` and `scored` hold
    them, so `retrain` can redo them."""
    tmp = tmp_path_factory.mktemp("deltas")
    config = run_config(tmp, "qwen2", "model.dtype=bfloat16", "trainer.checkpoint.whole_every=3", "trainer.threads=1")
    source, engine, trainer = Source(config, load_rows(config)[0], []), make_engine(config), Trainer(config, None)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    weights, sha256, manifests, scored = {}, {}, [], {}
    for step in range(1, STEPS + 1):
        released = [source.next_group(msgspec.structs.replace(INITIAL, version=step - 1)) for _ in range(GROUPS)]
        groups = [scored_group(g, engine, params, 100 * step + 10 * k) for k, g in enumerate(released)]
        trainer.train(groups)
        weights[step] = trainer.snapshot()
        published = trainer.publish(weights[step])
        sha256[step] = published.sha256
        engine.update_weights(WeightsFile(published.path, step, published.sha256, published.base_version))
        rows = [member for group in groups for member in group.trajectories()]
        manifests.append(
            BatchManifest(
                step=step,
                trainer_version=step - 1,
                trajectory_ids=[s.trajectory_id for s, _ in rows],
                scored_offsets=[where for _, where in rows],
                consumed_offsets=[],
            )
        )
        scored |= {where: s for s, where in rows}
    directory = runtime.weights_dir(config)
    assert runtime.versions_on_disk(directory) == [1, 3] and runtime.delta_versions_on_disk(directory) == [2, 4, 5]
    return DeltaRun(config, runtime.run_dir(config), weights, sha256, manifests, scored)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_export_of_a_delta_version_is_the_trainers_weights_bit_for_bit(delta_run: DeltaRun, tmp_path: Path):
    for version, out in ((None, tmp_path / "latest"), (2, tmp_path / "v2")):
        exported = export_model(delta_run.run_dir, version, out)
        note = json.loads((exported / "asyncrl.json").read_text())
        number = version or STEPS  # the newest on disk is delta version 5
        assert note["version"] == number and note["sha256"] == delta_run.sha256[number]
        assert note["weights_file"].endswith(f"v{number:06d}.delta.safetensors")
        saved = load_file(exported / "model.safetensors")
        assert all(torch.equal(saved[name], t) for name, t in delta_run.weights[number].items()), number


def test_eval_of_a_run_loads_a_delta_version(delta_run: DeltaRun, capsys):
    run = runtime.run_dir(delta_run.config)
    target = run_target(run, delta_run.config, "4")
    assert target.weights == runtime.delta_path(runtime.weights_dir(delta_run.config), 4)
    tensors, metadata = read_checked(target, run)
    assert same(tensors, delta_run.weights[4]) and metadata == {"version": "4"}
    args = ["eval", "--no-progress", "--max-new-tokens", "4", "--run", str(run), "--max-rows", "2"]
    assert cli(args) == 0  # latest: delta version 5
    assert json.loads(capsys.readouterr().out)["version"] == STEPS


def test_retrain_compares_with_a_delta_version_bit_for_bit(delta_run: DeltaRun):
    result = retrain(delta_run.config, 4, delta_run.manifests, delta_run.scored)
    assert result.compared_with.endswith("v000004.delta.safetensors") and result.from_step == 0
    assert result.bitwise_equal and len(result.max_abs_diff) == len(delta_run.weights[4])


def test_a_corrupt_delta_is_one_line_naming_the_version_and_the_file(delta_run: DeltaRun, tmp_path: Path, capsys):
    broken = runtime.delta_path(runtime.weights_dir(delta_run.config), 4)
    intact = broken.read_bytes()
    broken.write_bytes(intact[:-3] + bytes(b ^ 1 for b in intact[-3:]))  # the payload, its header's hash kept
    expected = f"asyncrl: weights v5: {broken.with_name('v000005.delta.safetensors')} is a delta on a broken chain: "
    expected += f"weights v4: delta {broken} is corrupt (its payload's sha256 is not its header's)"
    try:
        capsys.readouterr()
        assert cli(["export", "--run", str(delta_run.run_dir), "--out", str(tmp_path / "out")]) == 1
        assert capsys.readouterr().err.splitlines() == [expected]
        assert cli(["eval", "--no-progress", "--run", str(delta_run.run_dir), "--version", "5"]) == 1
        assert capsys.readouterr().err.splitlines() == [expected]
        with pytest.raises(RetrainError, match=f"^weights v4: delta {broken} is corrupt"):
            retrain(delta_run.config, 4, delta_run.manifests, delta_run.scored)
    finally:
        broken.write_bytes(intact)
