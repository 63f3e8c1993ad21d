"""Evaluation metrics, exact values: the unbiased pass@k, majority voting, length percentiles, the summary."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from workers.evaluator.scoring import majority, pass_at_k, summarise
from workers.reward.functions import answer_key
from workers.stats import percentile


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (10, 0, 1, 0.0),  # nothing right: 0 at any k
        (10, 0, 10, 0.0),
        (10, 10, 1, 1.0),  # everything right: 1 at any k
        (10, 10, 5, 1.0),
        (10, 3, 1, 0.3),  # k = 1 is c / n
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12
        (4, 1, 4, 1.0),  # n - c < k: some right sample is always among the k
        (8, 2, 4, 1 - 15 / 70),  # 1 - C(6,4)/C(8,4)
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_exact_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_is_the_probability_that_k_of_the_n_samples_contain_a_right_one() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                none_right = Fraction(comb(n - c, k), comb(n, k))  # k drawn without replacement, all wrong
                assert pass_at_k(n, c, k) == pytest.approx(float(1 - none_right), abs=1e-15)
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12, abs=1e-15)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


@pytest.mark.parametrize(
    ("keys", "winner"),
    [
        (["7", "8", "8", "7", "8"], 1),  # "8" three times: its first sample, index 1
        (["7", "8", "8", "7"], 0),  # a tie 2-2: the answer seen first ("7") wins
        (["8", "7", "7", "8"], 0),  # ... whichever it is
        (["", "5", "", "5", "6"], 0),  # no answer ("") is an answer like any other
        (["a", "b", "c"], 0),  # all different: the first
        (["x", "y", "z", "z"], 2),
        (["only"], 0),
    ],
)
def test_majority_picks_the_most_common_answer_first_occurrence_on_ties(keys: list[str], winner: int) -> None:
    assert majority(keys) == winner


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 90, 3.7),  # rank 0.9 * 3 = 2.7: 3 + 0.7 * (4 - 3)
        ([4, 1, 3, 2], 90, 3.7),  # order does not matter
        ([5], 50, 5.0),
        ([5], 90, 5.0),
        ([1, 2, 3, 4, 100], 50, 3.0),
        ([1, 2, 3, 4, 100], 90, 61.6),  # rank 3.6: 4 + 0.6 * 96
        ([10, 20], 0, 10.0),
        ([10, 20], 100, 20.0),
        ([], 50, 0.0),
    ],
)
def test_percentile_interpolates_linearly_between_ranks(values: list[int], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected, abs=1e-12)


def row(greedy: float, scores: list[float], majority_score: float | None, lengths: list[int]) -> dict:
    return {
        "greedy_score": greedy,
        "greedy_length": lengths[0],
        "sample_scores": scores,
        "sample_lengths": lengths[1:],
        "correct": sum(s >= 1.0 for s in scores),
        "majority_score": majority_score,
        "truncated": 0,
        "errors": [],
    }


def test_summary_of_two_rows_exact() -> None:
    rows = [
        row(1.0, [1.0, 0.0, 0.0, 1.0], 1.0, [3, 3, 4, 5, 6]),  # c = 2 of 4; the vote is right
        row(0.0, [0.0, 0.0, 0.0, 1.0], 0.0, [8, 2, 2, 2, 10]),  # c = 1 of 4; the vote is wrong
    ]
    summary = summarise(rows, k=4, temperature=0.7)
    assert summary["n"] == 2 and summary["k"] == 4 and summary["temperature"] == 0.7
    assert summary["greedy_accuracy"] == 0.5
    assert summary["pass_at_1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert summary["pass_at_k"] == 1.0  # n = k: any right sample passes
    assert summary["maj_at_k"] == 0.5
    assert summary["length_p50"] == 3.5  # of 2 2 2 3 3 4 5 6 8 10 (every completion, greedy too)
    assert summary["length_p90"] == pytest.approx(8.2)
    assert summary["pass_at_k"] >= summary["pass_at_1"]


def test_summary_without_samples_has_greedy_only() -> None:
    summary = summarise([row(1.0, [], None, [4]), row(0.5, [], None, [6])], k=0, temperature=1.0)
    assert summary["greedy_accuracy"] == 0.5  # partial credit is not full credit
    assert summary["greedy_mean_score"] == 0.75
    assert summary["pass_at_1"] is summary["pass_at_k"] is summary["maj_at_k"] is None


def test_answer_keys_for_majority_voting() -> None:
    assert answer_key("builtin", "arith")("15<eos>junk") == "15"  # the task's final_answer
    assert answer_key("builtin", "chain")("3+4=7;\\boxed{7}<eos>") == "7"
    assert answer_key("math")("so the answer is \\boxed{41}") == "41"  # math-verify's parse, as a string
    assert answer_key("math")("no number here") == ""
    assert answer_key("math")("15.0") == answer_key("math")("$\\frac{30}{2}$") == "15"  # one value, one vote
    assert answer_key("math")("1/2") == answer_key("math")("0.5") == "0.5"
    assert answer_key("my_rewards:exact")("  42 \n") == "42"  # a function of yours: the text
