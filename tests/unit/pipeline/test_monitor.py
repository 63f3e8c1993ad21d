"""The launcher's clock: how much of max_wall_s it keeps for the last version's evaluation."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.monitor import final_eval_reserve


@pytest.mark.parametrize(("longest", "reserve"), [(0.0, 0.0), (90.0, 90.0), (500.0, 375.0)])
def test_the_final_evaluation_keeps_the_longest_evaluation_s_time_at_most_a_quarter(longest, reserve):
    config = load_config(None, ["max_wall_s=1500"])
    assert final_eval_reserve(config, longest) == reserve


def test_without_a_bar_a_status_line_comes_at_the_first_step_every_30_s_and_at_the_last(capsys):
    from tqdm import tqdm

    from pipeline.monitor import StepDisplay

    now = [100.0]
    display = StepDisplay(tqdm(disable=True), steps=80, progress=False, clock=lambda: now[0])
    line = {"reward_mean": 0.41, "staleness_mean": 1.25, "tokens_per_s": 812.4}
    for step, at in ((1, 100.0), (2, 110.0), (3, 131.0), (80, 135.0)):
        now[0] = at
        display.show({**line, "step": step}, 0.17 if step > 2 else None)
    assert capsys.readouterr().out.splitlines() == [
        "asyncrl: step 1/80, reward 0.41, held-out -, staleness 1.2, 812 tok/s",
        "asyncrl: step 3/80, reward 0.41, held-out 0.17, staleness 1.2, 812 tok/s",
        "asyncrl: step 80/80, reward 0.41, held-out 0.17, staleness 1.2, 812 tok/s",
    ]


def test_with_a_bar_the_numbers_go_to_its_postfix_and_nothing_is_printed(capsys):
    from tqdm import tqdm

    from pipeline.monitor import StepDisplay

    bar = tqdm(disable=True)
    StepDisplay(bar, steps=10, progress=True).show(
        {"step": 1, "reward_mean": 0.5, "staleness_mean": 0.0, "tokens_per_s": 10.0}, None
    )
    assert (
        capsys.readouterr().out == "" and bar.postfix == "acc=-, reward=0.50, stale=0.0, tok_s=10"
    )  # tqdm sorts its keys
