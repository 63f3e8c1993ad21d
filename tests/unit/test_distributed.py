"""The token-balanced division of a minibatch's rows among the ranks (a pure function)."""

from workers.trainer.distributed import balance_rows


def test_longest_rows_go_to_the_rank_with_fewest_tokens():
    # 9 -> r0, 7 -> r1, 7 -> r1 (7 < 9), 5 -> r0 (9 < 14), 3 -> r0 (14 = 14, equal rows: lower rank), 2 -> r1
    assert balance_rows([5, 9, 2, 7, 7, 3], 2) == [[0, 1, 5], [2, 3, 4]]


def test_every_rank_gets_a_row_while_there_are_enough():
    assert balance_rows([0, 0, 0], 2) == [[0, 2], [1]]  # equal tokens: the rank with fewer rows first
    assert balance_rows([4, 6], 3) == [[1], [0], []]
    assert balance_rows([30, 4, 4, 5, 3, 6, 4, 5], 2) == [[0], [1, 2, 3, 4, 5, 6, 7]]


def test_one_rank_takes_everything_in_order():
    assert balance_rows([3, 1, 2], 1) == [[0, 1, 2]]
