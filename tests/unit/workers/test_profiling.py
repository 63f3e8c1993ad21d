"""The `profile` config: which steps torch.profiler records, from which threads, and what it writes."""

import json
import threading

import pytest
import structlog
import torch

from pipeline.config import load_config
from schemas.config import ProfileConfig
from workers.profiling import NoProfile, StepProfiler, step_profiler
from workers.runtime import WorkerContext


def recorded_steps(trace_path) -> list[str]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    return sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))


def op_names(trace_path) -> set[str]:
    return {e["name"] for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"}


def take_steps(profiler: StepProfiler, count: int) -> None:
    """Each step: a matmul on this thread and a sigmoid on another (as the trainer trains in a thread)."""
    x = torch.ones(8, 8)
    for _ in range(count):
        torch.mm(x, x)
        helper = threading.Thread(target=torch.sigmoid, args=(x,))
        helper.start()
        helper.join()
        profiler.step()


def test_records_the_window_after_start_from_every_thread(tmp_path):
    profiler = StepProfiler(
        ProfileConfig(roles=("trainer",), start=2, steps=3), tmp_path, "w", torch.device("cpu"), structlog.get_logger()
    )
    take_steps(profiler, 8)
    profiler.close()
    trace, ops = tmp_path / "w.trace.json", tmp_path / "w.ops.txt"
    assert recorded_steps(trace) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]  # 0-based
    assert {"aten::mm", "aten::sigmoid"} <= op_names(trace)  # the helper thread's op is there too
    table = ops.read_text()
    assert (
        table.startswith("w: steps 3-5 (ProfilerStep#2-#4 in the trace)")
        and "aten::mm" in table
        and "aten::sigmoid" in table
    )


def test_a_stop_inside_the_window_writes_what_was_recorded(tmp_path):
    profiler = StepProfiler(
        ProfileConfig(roles=("rollout",), start=1, steps=10), tmp_path, "w", torch.device("cpu"), structlog.get_logger()
    )
    take_steps(profiler, 3)
    profiler.close()
    # steps 2 and 3, then what followed the last step until the stop
    assert recorded_steps(tmp_path / "w.trace.json") == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    header = (tmp_path / "w.ops.txt").read_text().splitlines()[0]
    assert header.startswith("w: steps 2-3 (ProfilerStep#1-#2") and "#3 is what followed its last step" in header


def test_a_stop_before_the_window_writes_nothing(tmp_path):
    profiler = StepProfiler(
        ProfileConfig(roles=("rollout",), start=5, steps=2), tmp_path, "w", torch.device("cpu"), structlog.get_logger()
    )
    take_steps(profiler, 3)
    profiler.close()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("role, profiled", [("trainer", True), ("rollout", False), ("reward", False)])
def test_only_the_roles_named_are_profiled(tmp_path, role, profiled):
    config = load_config(overrides=[f"runs_dir={tmp_path}", "profile.roles=[trainer]"])
    ctx = WorkerContext(config, role, f"{role}-here-1", structlog.get_logger(), None, None)
    profiler = step_profiler(ctx)
    assert isinstance(profiler, StepProfiler) is profiled and isinstance(profiler, NoProfile) is not profiled
    profiler.close()


def test_a_role_that_has_no_steps_to_profile_is_refused_in_one_line():
    with pytest.raises(Exception, match="reward") as refused:
        load_config(overrides=["profile.roles=[trainer,reward]"])
    assert "\n" not in str(refused.value)
