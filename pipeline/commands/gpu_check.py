"""`asyncrl gpu-check` (`make gpu-check`): pipeline/bench/gpu.py; without CUDA it says so and runs nothing
(`--rehearse` runs the same checks on the CPU at toy sizes)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    gpu = commands.add_parser(
        "gpu-check",
        help="on a CUDA machine: the checks and benchmarks only a GPU can answer (docs: The GPU check)",
        description="Engine vs HF generate in bfloat16, bench pipeline with a ~100M-parameter model, packed "
        "attention on the GPU (SDPA per sequence and FlexAttention) against the CPU path, trainer steps over NCCL "
        "on one and two ranks, bench microbatch on cuda. A failing check does not stop the others; a summary "
        "table ends the output and the JSON is rewritten after each check. Exit 2 without CUDA, 1 if a check "
        "failed. --rehearse runs every check on the CPU at toy sizes (about 2 minutes on 2 cores), to find what "
        "would fail before a GPU's minutes are spent on it.",
    )
    gpu.add_argument(
        "--out",
        help="JSON results file, rewritten after each check; the checks' own files go in its folder "
        "(default: runs/bench/gpu-check.json; --rehearse: runs/bench/gpu-rehearsal.json, files in a folder of its "
        "name beside it, runs/bench/gpu-rehearsal/)",
    )
    gpu.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks (names as in the table)")
    gpu.add_argument(
        "--rehearse", action="store_true", help="run the checks on the CPU at toy sizes: no CUDA needed, no GPU numbers"
    )
    gpu.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    from pipeline.bench.gpu import main

    return main(args)
