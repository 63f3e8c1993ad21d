"""`bench generate`'s pure parts."""

from pipeline.bench.generate import decode_rows


def test_decode_rows_time_one_sixteen_the_powers_of_two_from_32_and_the_concurrency():
    assert decode_rows(4) == [1, 4, 16]
    assert decode_rows(64) == [1, 16, 32, 64]
    assert decode_rows(200) == [1, 16, 32, 64, 128, 200]
