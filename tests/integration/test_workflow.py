"""The Python tool of multi-turn rollouts (`workers/rollout/workflow.py`) answering from the real sandbox."""

from __future__ import annotations

from workers.rollout.workflow import PythonTool


def test_the_python_tool_answers_from_the_sandbox(bubblewrap):
    tool = PythonTool()
    assert tool.respond("17+6x2:1:[17+6]") == "23"
    assert tool.respond("[x = 4\nprint(x * 2)\nx + 1]") == "8\n5"
    assert tool.respond("[1/0]") == "error" and tool.respond("[open('/etc/passwd').read()]") == "error"
