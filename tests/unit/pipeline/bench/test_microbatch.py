"""`asyncrl bench microbatch`: its workload, the fixed count it compares against, its report (no timing asserted)."""

import statistics
from dataclasses import replace

import pytest

from pipeline.bench.microbatch import (
    PROMPT_LENGTHS,
    Settings,
    batch_lengths,
    check,
    fixed_count,
    summarize,
    table,
    workload,
)

SETTINGS = Settings(
    sequences=64,
    steps=3,
    max_length=512,
    budget=1024,
    hidden_size=64,
    layers=1,
    vocab_size=128,
    repeats=1,
    seed=0,
    threads=1,
    device="cpu",
)


def test_the_workload_is_long_tailed_and_the_same_for_every_process():
    assert workload(SETTINGS) == workload(SETTINGS)
    lengths = [n for batch in batch_lengths(SETTINGS) for n in batch]
    assert len(lengths) == (SETTINGS.steps + 1) * SETTINGS.sequences  # a warm-up batch, then the timed ones
    assert PROMPT_LENGTHS[0] < min(lengths) and max(lengths) <= SETTINGS.max_length
    assert statistics.median(lengths) < SETTINGS.max_length / 4 < SETTINGS.max_length * 0.8 < max(lengths)


def test_the_fixed_count_is_the_smallest_whose_micro_batches_fit_the_budget_in_every_batch():
    lengths = [[100, 100, 500, 100], [50, 50, 50, 50]]
    assert fixed_count(lengths, 800) == 1
    assert fixed_count(lengths, 600) == 2  # [100, 100] [500, 100]
    assert fixed_count(lengths, 550) == 4  # 3 parts: [100] [100] [500, 100]
    with pytest.raises(ValueError, match="longer than the budget"):
        fixed_count(lengths, 499)
    count = fixed_count(batch_lengths(SETTINGS), SETTINGS.budget)
    assert 1 < count < SETTINGS.sequences


def test_the_report_puts_both_ratios_on_top_and_every_setting_in():
    modes = {
        "dynamic": {
            "seconds": 2.0,
            "trained_tokens_per_s": 300.0,
            "microbatches_per_step": 4.0,
            "peak_memory_mib": 120.0,
            "seconds_all": [2.0],
            "largest_microbatch_tokens": 1024,
        },
        "fixed": {
            "seconds": 3.0,
            "trained_tokens_per_s": 200.0,
            "microbatches_per_step": 6.0,
            "peak_memory_mib": 100.0,
            "seconds_all": [3.0],
            "largest_microbatch_tokens": 900,
        },
    }
    report = summarize(SETTINGS, 6, batch_lengths(SETTINGS), modes)
    assert (report["dynamic_over_fixed"], report["peak_memory_ratio"]) == (1.5, 1.2)
    assert report["settings"]["fixed_count"] == 6 and report["settings"]["budget"] == 1024
    assert report["model"]["parameters"] > 0 and report["machine"]["torch_threads"] == 1
    assert "fixed(6)" in table(report) and "trained tokens/s 1.50x, peak memory 1.20x" in table(report)


def test_settings_that_cannot_be_compared_are_refused():
    assert check(SETTINGS) is None
    assert "--budget must hold the longest sequence" in check(replace(SETTINGS, budget=511))
    assert "multiple of 64" in check(replace(SETTINGS, hidden_size=100))
    assert "--dtype float16: float32 or bfloat16" in check(replace(SETTINGS, dtype="float16"))
