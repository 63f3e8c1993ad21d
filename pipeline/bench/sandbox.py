"""`asyncrl bench sandbox`: sandboxed executions per second (workers/sandbox/bwrap.py), cold and warm.

Cold: a fresh bwrap per execution. Warm: a fork of a warm server per execution, in fresh namespaces of its
own (`Zygote`), one server per execution running at once; the servers start before the clock does, as they
do once in a worker's life. Two programs: `pass` (the floor: the sandbox's set-up and teardown) and a small
checker that reads a completion on stdin and imports what a verifier would (json, re, math, fractions).
Each runs `--executions` times at each `--parallelism` (threads: an execution's work is in processes of its
own, so threads overlap them fully), with the CPU time each execution took in all its processes (the warm
servers' included). For scale, the same interpreter started alone, outside any sandbox (`python -I -c pass`).
"""

from __future__ import annotations

import argparse
import contextlib
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

from workers.sandbox.bwrap import WARM, Limits, find_python, require_bwrap, run_python

MODES = ("cold", "warm")

CHECKER = """\
import json, math, re, sys
from fractions import Fraction
text = sys.stdin.read()
numbers = [Fraction(n) for n in re.findall(r"-?[0-9]+(?:/[0-9]+)?", text)]
print(json.dumps({"sum": str(sum(numbers)), "root": math.isqrt(len(text))}))
"""
PROGRAMS = {"pass": ("pass", ""), "checker": (CHECKER, "3/4 + 12 = 51/4, so the answer is \\boxed{51/4}")}


def cpu_seconds() -> float:
    """CPU time of this process and of its children reaped so far (bwrap, and the sandbox's pid 1 with all it
    waited for, which `run_python` reaps here), and of the warm servers still running: their executions are
    reaped in the servers, whose own processes count them as their children's."""
    now = os.times()
    return now.user + now.system + now.children_user + now.children_system + servers_cpu_seconds()


def servers_cpu_seconds() -> float:
    """CPU time of the idle warm servers' processes and of the children they reaped (/proc/<pid>/stat)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for server in list(WARM.idle):
        for pid in server_pids(server.sandbox.process.pid):
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += sum(int(value) for value in fields[11:15]) / tick  # utime, stime, cutime, cstime
    return total


def server_pids(bwrap: int) -> list[int]:
    """bwrap, the sandbox's pid 1 and the server: each the first child of the one before."""
    pids = [bwrap]
    for _ in range(2):
        with contextlib.suppress(OSError, IndexError, ValueError):
            pids.append(int(Path(f"/proc/{pids[-1]}/task/{pids[-1]}/children").read_text().split()[0]))
    return pids


def measure(program: str, stdin: str, executions: int, parallelism: int, warm: bool) -> dict:
    """`executions` runs of `program`, `parallelism` at a time: executions per second, latencies, and the CPU time
    each took (the steadier measure on a machine shared with other work)."""
    with ThreadPoolExecutor(parallelism) as pool:
        if warm:  # a server per thread, started (and warm) before the clock
            list(pool.map(lambda _: run_python("pass", "", Limits(), warm=True), range(parallelism)))
        started, cpu = time.perf_counter(), cpu_seconds()
        done = list(pool.map(lambda _: run_python(program, stdin, Limits(), warm=warm), range(executions)))
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
    columns = ("parallel", "exec/s", "p50 ms", "p90 ms", "CPU ms")
    lines = [f"{'mode':<5} {'program':<8} " + " ".join(f"{column:>8}" for column in columns) + f" {'failed':>6}"]
    for mode in MODES:
        for row in report[mode]:
            lines.append(
                f"{mode:<5} {row['program']:<8} {row['parallelism']:>8} {row['per_s']:>8} {row['latency_ms_p50']:>8} "
                f"{row['latency_ms_p90']:>8} {row['cpu_ms']:>8} {row['failures']:>6}"
            )
    lines.append(f"warm/cold executions per second, row by row: {report['warm_over_cold']}")
    alone = report["python_alone"]
    lines.append(
        f"python -I -c pass alone, outside the sandbox: {alone['ms']} ms, {alone['cpu_ms']} ms CPU ({alone['per_s']}/s)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    bwrap = require_bwrap()  # also warms the page cache
    report = {"executions": args.executions, "limits": asdict(Limits()), "machine": machine(bwrap)}
    for mode in MODES:
        report[mode] = [
            {"program": name, **measure(program, stdin, args.executions, parallelism, warm=mode == "warm")}
            for name, (program, stdin) in PROGRAMS.items()
            for parallelism in args.parallelism
        ]
        WARM.close()
    report["python_alone"] = python_alone(args.executions)
    rows = zip(report["cold"], report["warm"], strict=True)
    report["warm_over_cold"] = [round(warm["per_s"] / cold["per_s"], 2) for cold, warm in rows]
    print(table(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if failed := [row for mode in MODES for row in report[mode] if row["failures"]]:
        print(f"asyncrl: {failed[0]['failures']} executions failed: {failed[0]['first_failure']}", file=sys.stderr)
        return 1
    return 0
