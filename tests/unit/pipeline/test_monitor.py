"""The launcher's clock: how much of max_wall_s it keeps for the last version's evaluation."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.monitor import final_eval_reserve


@pytest.mark.parametrize(("longest", "reserve"), [(0.0, 0.0), (90.0, 90.0), (500.0, 375.0)])
def test_the_final_evaluation_keeps_the_longest_evaluation_s_time_at_most_a_quarter(longest, reserve):
    config = load_config(None, ["max_wall_s=1500"])
    assert final_eval_reserve(config, longest) == reserve
