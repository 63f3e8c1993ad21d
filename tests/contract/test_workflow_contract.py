"""What every workflow promises (`workers/rollout/workflow.py`): a one-character `call_end`, a reply as text for a
transcript ending with it, and worked solutions still worked solutions; the docs' one-file example
(docs/pages/guides/multi-turn-tools.md) loads and answers as it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workers.rollout.workflow import BUILTIN, Workflow, load_workflow

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "pages" / "guides" / "multi-turn-tools.md"


def guide_example(tmp_path: Path) -> str:
    """The guide's example workflow, written to its own file; its `rollout.workflow` spec."""
    [code] = re.findall(r"```python\n(# my_workflow\.py.*?)```", GUIDE.read_text(), flags=re.S)
    path = tmp_path / "my_workflow.py"
    path.write_text(code)
    return f"{path}:Lookup"


@pytest.fixture(params=[*BUILTIN, "guide"])
def workflow(request, tmp_path, bubblewrap) -> Workflow:
    return load_workflow(guide_example(tmp_path) if request.param == "guide" else request.param)


def test_a_workflow_replies_with_text_to_a_transcript_ending_with_its_call(workflow: Workflow):
    assert len(workflow.call_end) == 1 and workflow.max_calls >= 1 and workflow.max_reply_chars >= 1
    workflow.check()
    reply = workflow.respond(f"17+6x1:0:[17+6{workflow.call_end}")
    assert isinstance(reply, str)
    solution = "0:17+6=23;\\boxed{23}"
    assert "\\boxed{23}" in workflow.demonstrate(solution)


def test_the_guide_example_answers_as_it_says(tmp_path: Path):
    lookup = load_workflow(guide_example(tmp_path))
    assert lookup.respond("The capital Rome?") == " italy." and lookup.respond("Atlantis?") == " unknown."
