"""A worker that keeps failing ends the run; the console must say why, not only where its log is."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline import monitor
from pipeline.launch.worker_processes import WorkerProcess

CRASH = """reward worker starting
Traceback (most recent call last):
  File "/work/rewards.py", line 3, in score
    raise ValueError("no answer in the completion")
ValueError: no answer in the completion
Unclosed AIOKafkaProducer
producer: <aiokafka.producer.producer.AIOKafkaProducer object at 0x7f>
"""


def test_a_worker_out_of_restarts_shows_its_exception_and_log_tail(tmp_path) -> None:
    log = tmp_path / "reward-1.stdout"
    log.write_text("earlier line\n" * 50 + CRASH)
    worker = WorkerProcess("reward", 1, tmp_path / "config.yaml", log, restarts=monitor.MAX_RESTARTS)
    said = []

    assert not monitor.restart_exited([worker], [1], SimpleNamespace(write=said.append))

    head, *tail = said[0].splitlines()
    assert head == (
        f"asyncrl: reward-1 failed {monitor.MAX_RESTARTS + 1} times (exit 1): ValueError: no answer in the completion"
    )
    last_lines = log.read_text().splitlines()[-monitor.ERROR_TAIL_LINES :]
    assert tail == [f"    {line}" for line in last_lines] + [f"    (all of it: {log})"]
    assert '    raise ValueError("no answer in the completion")' in last_lines


def test_a_worker_without_a_log_still_gets_its_one_line(tmp_path) -> None:
    worker = WorkerProcess("prompts", 2, tmp_path / "config.yaml", tmp_path / "missing.stdout", restarts=9)

    report = monitor.failure_report(worker, -9)

    assert report.splitlines()[0] == "asyncrl: prompts-2 failed 10 times (exit -9): no exception line in its log"


def test_an_evaluator_out_of_restarts_costs_the_evaluation_not_the_run(tmp_path) -> None:
    log = tmp_path / "eval-0.stdout"
    log.write_text(CRASH)
    worker = WorkerProcess("eval", 0, tmp_path / "config.yaml", log, restarts=monitor.MAX_RESTARTS)
    said = []

    assert monitor.restart_exited([worker], [1], SimpleNamespace(write=said.append))
    assert monitor.restart_exited([worker], [1], SimpleNamespace(write=said.append))  # polled again: said once

    [report] = said
    assert report.startswith("asyncrl: eval-0 failed") and report.endswith("the run goes on without evaluation")
