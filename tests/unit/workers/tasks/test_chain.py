"""The `chain` task: worked solutions, its verifier, and the long-tailed lengths it exists for."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from math_verify import parse, verify

from tests.unit.workers.tasks.fixed_draws import Draws
from workers.tasks import EOS_TEXT
from workers.tasks.chain import Chain, teacher_solution, worked_solution

CHAIN = Chain()


def test_worked_solution_exact():
    assert worked_solution(17, 6, 4) == "3:17+6=23,2:23+6=29,1:29+6=35,0:35+6=41;\\boxed{41}"
    assert worked_solution(95, 9, 1) == "0:95+9=104;\\boxed{104}"


def test_score_reads_only_the_final_boxed_answer_before_the_end():
    assert CHAIN.score("17+6=23;\\boxed{41}" + EOS_TEXT, "41") == 1.0  # only the final answer counts
    assert CHAIN.score("17+6=23+6=29;\\boxed{29}", "41") == 0.0
    assert CHAIN.score("17+6=23+6=29+6=35+6=41", "41") == 0.0  # no \boxed{}: no answer
    assert CHAIN.score("\\boxed{40}" + EOS_TEXT + "\\boxed{41}", "41") == 0.0  # after the end token: ignored
    assert CHAIN.score("\\boxed{7}\\boxed{41}", "41") == 1.0  # the last one
    assert CHAIN.final_answer("x;\\boxed{104}" + EOS_TEXT) == "104"
    assert CHAIN.final_answer("no answer") == ""


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"\A[0-9]{1,12}\Z"), st.from_regex(r"\A[0-9]{1,12}\Z"))
def test_digit_answers_get_math_verifys_verdict(answer, final):
    """The integer comparison of two digit strings is math-verify's verdict (leading zeros included)."""
    gold, predicted = parse(answer), parse(final)
    expected = 1.0 if gold and predicted and verify(gold, predicted) else 0.0
    assert CHAIN.score(f"\\boxed{{{final}}}", answer) == expected
    assert CHAIN.score(f"\\boxed{{{answer}}}", answer) == 1.0


def test_digit_answers_skip_sympy(monkeypatch):
    def refuse(*_):
        raise AssertionError("math-verify parsed a digit string")

    monkeypatch.setattr("math_verify.parse", refuse)
    assert CHAIN.score("\\boxed{041}", "41") == 1.0
    assert CHAIN.score("\\boxed{42}", "41") == 0.0


def test_other_answers_go_to_math_verify():
    assert CHAIN.score("\\boxed{41.0}", "41") == 1.0  # not a digit string: math-verify reads the number
    assert CHAIN.score("\\boxed{4 1}", "41") == 0.0


def test_lengths_are_long_tailed():
    train, _ = CHAIN.split(0, 200)
    lengths = sorted(len(p.solution) + 1 for p in train)  # one token per character, plus the end token
    p50, p90 = lengths[len(lengths) // 2], lengths[int(0.9 * len(lengths))]
    assert lengths[0] <= 25 and lengths[-1] >= 200
    assert p90 / p50 >= 3


def test_the_warm_up_teacher_forgets_carries_and_only_carries():
    assert teacher_solution(17, 6, 4, Draws(1.0)) == worked_solution(17, 6, 4)
    assert teacher_solution(17, 6, 4, Draws(0.0)) == "3:17+6=13,2:13+6=19,1:19+6=15,0:15+6=11;\\boxed{11}"
    assert teacher_solution(11, 2, 3, Draws(0.0)) == worked_solution(11, 2, 3)  # no carry: nothing to forget


def test_demonstrations_keep_prompts_and_answers_and_err_only_in_solutions():
    train, _ = CHAIN.split(0, 200)
    shown = CHAIN.demonstrations(train[:2000], seed=0)
    assert [(p.prompt, p.answer) for p in shown] == [(p.prompt, p.answer) for p in train[:2000]]
    wrong = sum(p.solution != q.solution for p, q in zip(shown, train, strict=False))
    assert 0.3 < wrong / len(shown) < 0.8  # most chains have a carry; 60 % of carries are forgotten
    assert CHAIN.demonstrations(train[:50], seed=0) == shown[:50]  # seeded
