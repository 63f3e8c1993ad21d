"""bench pipeline's window: rates after warm-up and the trainer's busy share, from metrics lines."""

from pipeline.bench.pipeline import window_rates


def trainer(step: int, time: float, step_seconds: float) -> dict:
    return {
        "source": "trainer",
        "step": step,
        "time": time,
        "step_seconds": step_seconds,
        "trained_tokens": 100 * step,
        "staleness_mean": 1.0,
        "interrupted_trajectories": step,
    }


def test_window_rates_after_warm_up():
    lines = [
        trainer(1, 0.0, 9.0),
        trainer(2, 1.0, 0.5),
        trainer(3, 2.0, 0.25),
        trainer(4, 3.0, 0.75),
        {"source": "rollout", "time": 1.0, "generated_tokens": 50},
        {"source": "rollout", "time": 3.0, "generated_tokens": 450},
    ]
    rates = window_rates(lines, warmup_steps=2)  # from step 2 (t=1) to step 4 (t=3): steps 3 and 4
    assert rates["steps_measured"] == 2 and rates["seconds"] == 2.0
    assert rates["trained_tokens_per_s"] == 100.0 and rates["steps_per_s"] == 1.0
    assert rates["generated_tokens_per_s"] == 200.0
    assert rates["train_step_seconds"] == 0.5 and rates["trainer_busy"] == 0.5  # (0.25 + 0.75) / 2 s
    assert rates["window"] == (1.0, 3.0)  # where the CPU sampler reads the cores used
