"""`asyncrl prepare` writes a deployment's config.yaml: its workers join their consumer groups, whatever the
run directory's config.yaml says (a local run's says launcher.sole_consumers: true)."""

from __future__ import annotations

import yaml

from pipeline.cli import main as cli


def test_a_deployment_s_workers_join_their_groups_even_from_a_local_run_s_config(tmp_path, broker, capsys):
    run = ["prepare", f"runs_dir={tmp_path}", "name=dep", f"broker.bootstrap={broker.bootstrap}"]
    run += ["model.warmup_steps=0", f"broker.topic_prefix={tmp_path.name}."]
    assert cli(run) == 0
    path = tmp_path / "dep" / "config.yaml"
    assert capsys.readouterr().out.strip() == str(path)
    assert yaml.safe_load(path.read_text())["launcher"]["sole_consumers"] is False
    path.write_text(path.read_text().replace("sole_consumers: false", "sole_consumers: true"))  # as `asyncrl run` saves
    assert cli(run) == 0  # prepared again: the run directory keeps its config.yaml, but not that
    assert yaml.safe_load(path.read_text())["launcher"]["sole_consumers"] is False


def test_a_deployment_on_an_embedded_broker_says_so_by_a_flag(tmp_path, broker, capsys):
    run = ["prepare", "--embedded-broker", f"runs_dir={tmp_path}", "name=emb", f"broker.bootstrap={broker.bootstrap}"]
    assert cli([*run, "model.warmup_steps=0", f"broker.topic_prefix={tmp_path.name}."]) == 0
    launcher = yaml.safe_load((tmp_path / "emb" / "config.yaml").read_text())["launcher"]
    assert launcher == {"cores": 0, "embedded_broker": True, "sole_consumers": False}
