"""`asyncrl bench microbatch` end to end: both modes, each in a process of its own."""

import json

from pipeline.cli import main


def test_bench_microbatch_runs_both_modes_in_their_own_processes(tmp_path):
    out = tmp_path / "microbatch.json"
    assert (
        main(
            [
                "bench",
                "microbatch",
                "--sequences",
                "6",
                "--steps",
                "1",
                "--max-length",
                "80",
                "--budget",
                "160",
                "--hidden-size",
                "64",
                "--layers",
                "1",
                "--vocab-size",
                "4096",
                "--repeats",
                "1",
                "--dtype",
                "bfloat16",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["dynamic_over_fixed"] > 0 and report["peak_memory_ratio"] > 0
    assert report["model"]["compute_dtype"] == report["settings"]["dtype"] == "bfloat16"
    for mode in report["modes"].values():
        assert mode["largest_microbatch_tokens"] <= 160 and mode["peak_memory_mib"] > 0
