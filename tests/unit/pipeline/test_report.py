"""The run report: TensorBoard events hold the scalars and the per-step staleness histogram, written anew."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.report import write_tensorboard


def test_tensorboard_gets_scalars_and_the_staleness_histogram(tmp_path):
    lines = [
        {"source": "trainer", "step": 1, "time": 1.0, "loss": 0.5, "staleness_histogram": [3, 0, 1]},
        {"source": "trainer", "step": 2, "time": 2.0, "loss": 0.25, "staleness_histogram": [1]},
    ]
    write_tensorboard(lines, tmp_path)
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0}).Reload()
    assert [e.value for e in events.Scalars("trainer/loss")] == [0.5, 0.25]
    first, second = events.Histograms("trainer/staleness")
    assert (first.step, first.histogram_value.num, first.histogram_value.max, first.histogram_value.sum) == (1, 4, 2, 2)
    assert (second.step, second.histogram_value.num, second.histogram_value.max) == (2, 1, 0)


def test_tensorboard_is_written_anew_so_an_earlier_launch_s_lines_do_not_stay(tmp_path):
    first = [{"source": "trainer", "step": step, "time": 1.0, "loss": 1.0} for step in (1, 2, 3)]
    write_tensorboard(first, tmp_path)
    write_tensorboard([{"source": "trainer", "step": 1, "time": 2.0, "loss": 0.5}], tmp_path)  # a resumed run's report
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("trainer/loss")] == [(1, 0.5)]


def test_a_line_with_an_empty_staleness_histogram_has_its_scalars_and_no_histogram(tmp_path):
    """An empty histogram stopped a finished run's report (TensorBoard refuses one with no element)."""
    lines = [{"source": "trainer", "step": 1, "time": 1.0, "loss": 0.5, "staleness_histogram": []}]
    write_tensorboard(lines, tmp_path)
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0}).Reload()
    assert [e.value for e in events.Scalars("trainer/loss")] == [0.5]
    assert "trainer/staleness" not in events.Tags()["histograms"]
