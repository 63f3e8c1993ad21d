"""`asyncrl bench sandbox`: sandboxed executions per second (workers/reward/sandbox.py), a fresh bwrap each.

Two programs: `pass` (the floor: bwrap's set-up, Python's start-up, the sandbox's teardown) and a small
checker that reads a completion on stdin and imports what a verifier would (json, re, math, fractions).
Each runs `--executions` times at each `--parallelism` (threads: every execution is a bwrap process of its
own, so threads overlap them fully), with the CPU time each execution took in all its processes. For
scale, the same interpreter started alone, outside any sandbox (`python -I -c pass`): that start-up is
what a warm interpreter could save at most per execution, and the rest is the sandbox's own cost. There
is no warm mode (see the sandbox module for why).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from workers.reward.sandbox import Limits, find_python, require_bwrap, run_python

CHECKER = """\
import json, math, re, sys
from fractions import Fraction
text = sys.stdin.read()
numbers = [Fraction(n) for n in re.findall(r"-?[0-9]+(?:/[0-9]+)?", text)]
print(json.dumps({"sum": str(sum(numbers)), "root": math.isqrt(len(text))}))
"""
PROGRAMS = {"pass": ("pass", ""), "checker": (CHECKER, "3/4 + 12 = 51/4, so the answer is \\boxed{51/4}")}


def cpu_seconds() -> float:
    """CPU time of this process and of its children reaped so far: bwrap, and the sandbox's pid 1 with all it
    waited for (the program), which `run_python` reaps here."""
    now = os.times()
    return now.user + now.system + now.children_user + now.children_system


def measure(program: str, stdin: str, executions: int, parallelism: int) -> dict:
    """`executions` runs of `program`, `parallelism` at a time: executions per second, latencies, and the CPU time
    each took (the steadier measure on a machine shared with other work)."""
    started, cpu = time.perf_counter(), cpu_seconds()
    with ThreadPoolExecutor(parallelism) as pool:
        done = list(pool.map(lambda _: run_python(program, stdin, Limits()), range(executions)))
    wall, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    latencies = sorted(execution.seconds * 1000 for execution in done)
    failures = [execution.reason for execution in done if execution.status != "ok"]
    return {
        "parallelism": parallelism,
        "executions": executions,
        "per_s": round(executions / wall, 1),
        "latency_ms_p50": round(statistics.median(latencies), 1),
        "latency_ms_p90": round(latencies[int(len(latencies) * 0.9)], 1),
        "cpu_ms": round(cpu / executions * 1000, 1),
        "failures": len(failures),
        "first_failure": failures[0] if failures else None,
    }


def python_alone(executions: int) -> dict:
    """The sandbox's interpreter started `executions` times outside any sandbox, one at a time."""
    command = [find_python(), "-I", "-c", "pass"]
    started, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(executions):
        subprocess.run(command, check=True)
    wall, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {
        "executions": executions,
        "per_s": round(executions / wall, 1),
        "ms": round(wall / executions * 1000, 1),
        "cpu_ms": round(cpu / executions * 1000, 1),
    }


def machine(bwrap: str) -> dict:
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "bwrap": version,
        "python_in_sandbox": find_python(),
        "platform": platform.platform(),
    }


def table(report: dict) -> str:
    lines = [f"{'program':<8} {'parallel':>8} {'exec/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'CPU ms':>8} {'failed':>6}"]
    for row in report["cold"]:
        lines.append(
            f"{row['program']:<8} {row['parallelism']:>8} {row['per_s']:>8} {row['latency_ms_p50']:>8} "
            f"{row['latency_ms_p90']:>8} {row['cpu_ms']:>8} {row['failures']:>6}"
        )
    alone = report["python_alone"]
    lines.append(
        f"python -I -c pass alone, outside the sandbox: {alone['ms']} ms, {alone['cpu_ms']} ms CPU ({alone['per_s']}/s)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    bwrap = require_bwrap()  # also warms the page cache
    cold = [
        {"program": name, **measure(program, stdin, args.executions, parallelism)}
        for name, (program, stdin) in PROGRAMS.items()
        for parallelism in args.parallelism
    ]
    report = {
        "executions": args.executions,
        "limits": asdict(Limits()),
        "machine": machine(bwrap),
        "cold": cold,
        "python_alone": python_alone(args.executions),
        "warm": None,  # no warm mode: see workers/reward/sandbox.py
    }
    print(table(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if failed := [row for row in cold if row["failures"]]:
        print(f"asyncrl: {failed[0]['failures']} executions failed: {failed[0]['first_failure']}", file=sys.stderr)
        return 1
    return 0
