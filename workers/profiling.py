"""Where a worker's step time goes, op by op: torch.profiler over a window of its steps (the `profile` config).

The unit is the trainer's optimizer step (rank 0's, with the manifest, weight write, announcement and
checkpoint around it) or a rollout worker's engine step. `start` steps pass unrecorded (the first ones warm
caches and allocators), then `steps` are recorded, every thread of the process included: the trainer trains in
a thread, and an engine step that prefills runs in one. When the window closes, or the worker stops inside it,
two files go to <run dir>/profile/: `<worker id>.trace.json` (Chrome trace format: open it in Perfetto or
chrome://tracing; each step is a `ProfilerStep#N` span) and `<worker id>.ops.txt` (the ops by self time,
summed over the window; CUDA time first on a GPU).
"""

from __future__ import annotations

from pathlib import Path

import structlog
import torch
from torch.profiler import ProfilerActivity

from schemas.config import ProfileConfig
from workers.runtime import WorkerContext


class NoProfile:
    """A worker whose role is not profiled: its steps cost nothing more."""

    def step(self) -> None:
        pass

    def close(self) -> None:
        pass


class StepProfiler:
    """Records steps start+1 .. start+steps of the worker that calls `step()` after each of its steps."""

    def __init__(
        self, profile: ProfileConfig, folder: Path, name: str, device: torch.device, log: structlog.stdlib.BoundLogger
    ):
        self.folder, self.name, self.log, self.start = folder, name, log, profile.start
        cuda = device.type == "cuda"
        self.sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
        self.shapes = profile.record_shapes
        self.taken, self.stopping = 0, False
        self.written = False
        self.profiler = torch.profiler.profile(
            activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])],
            schedule=torch.profiler.schedule(
                wait=max(profile.start - 1, 0), warmup=min(profile.start, 1), active=profile.steps, repeat=1
            ),
            on_trace_ready=self.write,
            record_shapes=profile.record_shapes,
            with_stack=profile.with_stack,
            experimental_config=all_threads(log),
        )
        self.profiler.start()

    def step(self) -> None:
        self.taken += 1
        self.profiler.step()

    def close(self) -> None:
        """Ends the recording (writing what a window cut short holds)."""
        self.stopping = True
        self.profiler.stop()
        if not self.written:
            self.log.warning("profile: nothing recorded", steps_taken=self.taken, recording_starts_after=self.start)

    def write(self, profiler: torch.profiler.profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace, ops = self.folder / f"{self.name}.trace.json", self.folder / f"{self.name}.ops.txt"
        profiler.export_chrome_trace(str(trace))
        table = profiler.key_averages(group_by_input_shape=self.shapes).table(sort_by=self.sort_by, row_limit=40)
        first, last = self.start + 1, self.taken
        ops.write_text(
            f"{self.name}: steps {first}-{last} (ProfilerStep#{first - 1}-#{last - 1} in the trace), ops by self "
            f"time; ProfilerStep*'s own is the steps' time outside torch ops (waiting, Python)"
            + (
                f"; the worker stopped inside the window: #{last} is what followed its last step"
                if self.stopping
                else ""
            )
            + f"\n{table}\n"
        )
        self.written = True
        self.log.info("profile written", trace=str(trace), ops=str(ops))


def all_threads(log: structlog.stdlib.BoundLogger):
    """Kineto's switch that records ops on every thread, not only the one that started the profiler; a torch
    without it records the main thread only (said in the log)."""
    try:
        return torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        log.warning("profile: this torch records the worker's main thread only (no profile_all_threads)")
        return None


def step_profiler(ctx: WorkerContext) -> StepProfiler | NoProfile:
    """A profiler for this worker if the run profiles its role, else one that does nothing."""
    if ctx.role not in ctx.config.profile.roles:
        return NoProfile()
    device = torch.device(ctx.config.model.device)
    return StepProfiler(ctx.config.profile, ctx.run_dir / "profile", ctx.id, device, ctx.log)
