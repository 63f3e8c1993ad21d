"""`asyncrl bench generate` runs end to end on a tiny setting and reports what its JSON promises
(no timing asserted)."""

import json

from pipeline.cli import main


def test_bench_generate_writes_its_headline_and_settings(tmp_path, capsys):
    out = tmp_path / "generate.json"
    assert (
        main(
            [
                "bench",
                "generate",
                "--requests",
                "8",
                "--concurrency",
                "4",
                "--max-new-tokens",
                "8",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["speedup_vs_hf"] > 0 and result["speedup_vs_hf_fixed"] > 0
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["torch"]
    assert result["settings"]["concurrency"] == 4 and result["settings"]["requests"] == 8
    for scenario in result["scenarios"].values():
        # both systems produced exactly the useful tokens the lengths asked for
        assert scenario["lengths"]["total"] > 0 and scenario["engine"]["tokens_per_s"] > 0
        assert scenario["speedup_vs_hf_cpu"] > 0 and scenario["hf"]["cpu_seconds_min"] > 0
        assert scenario["engine"]["forward"] == "DirectForward"  # the demo model is a Qwen2
    costs = result["step_costs"]  # what interruption costs: decode steps by rows, a full re-prefill
    assert set(costs["decode_step_ms"]) == {"1", "4", "16"} and min(costs["decode_step_ms"].values()) > 0
    assert costs["reprefill_ms"] > 0 and costs["reprefill_rows"] > 0
    ceiling = result["matmul_ceiling"]  # the matmuls alone at the bench's concurrency, and the engine's share
    assert ceiling["rows"] == 4 and ceiling["tokens_per_s"] > 0
    share = result["scenarios"]["long_tailed"]["engine"]["tokens_per_s"] / ceiling["tokens_per_s"]
    assert result["engine_share_of_matmul_ceiling"] == round(share, 3) > 0
    used = result["utilisation"]  # the run's own one-thread ceiling in its dtype, and each system's share of it
    assert used["dtype"] == result["settings"]["dtype"] == "float32"  # --dtype auto: the demo model stays float32
    assert used["ceiling_gflops_per_core"] > 0 and used["ceiling_decode_shape_gflops_per_core"] > 0
    assert result["engine_mfu"] == used["scenarios"]["long_tailed"]["engine_mfu"] > 0
    steps = used["decode_steps"]  # each timed batch size's step against its matmuls alone
    assert set(steps) == {"1", "4", "16"} and all(r["mfu"] > 0 and r["matmul_mfu"] > 0 for r in steps.values())
    assert steps["16"]["step_ms"] == costs["decode_step_ms"]["16"]
    printed = capsys.readouterr().out
    assert "MFU" in printed and "GFLOP/s per core in float32" in printed
    assert "speedup" in printed and "re-prefilling" in printed and "matmul ceiling at 4 rows" in printed
    assert "decode step at 16 rows" in printed
