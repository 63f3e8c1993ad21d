"""The committed reference pages are what the code generates: a schema or CLI change without
`python -m pipeline.reference` fails here (and in `make docs`)."""

from typing import Annotated, Literal

import msgspec
import pytest

from pipeline import reference


@pytest.mark.parametrize("page", ["config.md", "cli.md"])
def test_committed_page_equals_generated(page):
    path = reference.PAGES / page
    assert path.read_text() == reference.pages()[path], f"run `python -m pipeline.reference` ({page} is stale)"


def test_check_exits_1_with_one_line_on_a_stale_page(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "PAGES", tmp_path / "docs" / "pages" / "reference")
    assert reference.main([]) == 0
    assert reference.main(["--check"]) == 0
    (reference.PAGES / "cli.md").write_text("edited by hand\n")
    assert reference.main(["--check"]) == 1
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "docs/pages/reference/cli.md" in message


def test_every_config_field_is_listed():
    page = reference.config_page()
    for name in ("name", "broker.bootstrap", "trainer.optim.lr", "trainer.loss.kl_coef", "eval.k"):
        assert f"| `{name}` |" in page


def test_every_command_has_a_section():
    page = reference.cli_page()
    for command in ("run", "worker", "eval", "bench generate", "replay retrain", "topics import"):
        assert f"`asyncrl {command}`" in page


def test_types_read_as_words():
    assert reference.type_name(int | None) == "int or null"
    assert reference.type_name(Literal["raw", "chat"]) == 'one of "raw", "chat"'
    assert reference.type_name(Annotated[list[str], msgspec.Meta(min_length=1)]) == "list of str"
    assert reference.type_name(dict[str, float]) == "map of str to float"


def test_cells_hold_no_markup():
    assert reference.cell("a|b <dir> *x*") == "a\\|b &lt;dir> \\*x\\*"
