"""TensorBoard as a destination of the reports (`engine/trackers/tensorboard.py`) and the delivery that loses
none of them (`engine/trackers/delivery.py`), read back from the real event files with tensorboard's own
`EventAccumulator`: every key at every step with the value sent, the per-task table as a text summary,
the plot as an image; a folder that can not be written is a warning and an error count, and what it
missed reaches it, in step order, once it can be written (or the summary names the steps it lacks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dflash_callbacks.engine.trackers.delivery import Delivery
from dflash_callbacks.engine.trackers.tensorboard import TensorBoardTracker, markdown_table

from tracker_reports import make_plot, read_events, report_payload, scalars


def expected_scalars(steps) -> dict[str, list[tuple[int, float]]]:
    """What was sent, as TensorBoard keeps it (float32)."""
    out: dict[str, list] = {}
    for step in steps:
        for key, value in report_payload(step)[0].items():
            out.setdefault(key, []).append((step, float(np.float32(value))))
    return out


@pytest.fixture(scope="module")
def plot(tmp_path_factory) -> Path:
    return make_plot(tmp_path_factory.mktemp("plot") / "plot.png")


def test_every_key_step_table_and_the_plot_read_back(tmp_path, plot):
    warnings: list[str] = []
    delivery = Delivery([TensorBoardTracker(tmp_path / "tb")], warnings.append)
    for step in (2, 4, 6):
        delivery.send(step, *report_payload(step))
    delivery.send_image("dflash/plot", plot)
    assert delivery.finish() == [] and warnings == [] and delivery.errors == {"tensorboard": 0}
    events = read_events(tmp_path / "tb")
    assert scalars(events) == expected_scalars((2, 4, 6))
    assert "dflash/ddtree@4/live/py3.11" in scalars(events)  # the task's dot and the method's '@' as they are
    texts = events.Tensors("dflash/live_table/text_summary")
    assert [t.step for t in texts] == [2, 4, 6]
    for text, step in zip(texts, (2, 4, 6)):
        table = report_payload(step)[1]
        assert text.tensor_proto.string_val[0].decode() == markdown_table(table.columns, table.rows)
    assert "dflash/live_table" not in scalars(events)
    (image,) = events.Images("dflash/plot")
    assert (image.step, image.width, image.height) == (6, 300, 200)  # at the last step logged


def test_a_folder_that_can_not_be_written_gets_what_it_missed_in_step_order_once_it_can(tmp_path):
    """The folder's path is a file at steps 2 and 4: two warnings, two errors, nothing written; once it
    is a folder, step 6 brings steps 2 and 4 first, and every report is in the event files."""
    folder = tmp_path / "tb"
    folder.write_text("a file where the folder goes")
    warnings: list[str] = []
    delivery = Delivery([TensorBoardTracker(folder)], warnings.append)
    for step in (2, 4):
        delivery.send(step, *report_payload(step))
    assert delivery.errors == {"tensorboard": 2}
    assert len(warnings) == 2 and warnings[0].startswith("tensorboard: step 2 not sent (FileExistsError")
    assert "2 item(s) held" in warnings[0] and "4 item(s) held" in warnings[1]  # metrics and table of each step
    folder.unlink()
    delivery.send(6, *report_payload(6))
    assert warnings[2] == "tensorboard is back: sent the 4 item(s) it had missed (steps 2, 4)"
    assert delivery.finish() == ["tensorboard: 2 error(s); every report reached it in the end"]
    events = read_events(folder)
    assert scalars(events) == expected_scalars((2, 4, 6))
    assert [t.step for t in events.Tensors("dflash/live_table/text_summary")] == [2, 4, 6]


def test_a_tracker_that_never_comes_back_is_named_with_the_steps_it_lacks(tmp_path, plot):
    """One tracker fails throughout, the other gets everything: the summary names the steps and the plot the
    failing one lacks, and only it."""
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    good, bad = TensorBoardTracker(tmp_path / "good"), TensorBoardTracker(blocked)
    bad.name = "tensorboard-blocked"
    warnings: list[str] = []
    delivery = Delivery([bad, good], warnings.append)
    for step in (2, 4, 6):
        delivery.send(step, *report_payload(step))
    delivery.send_image("dflash/plot", plot)
    assert delivery.finish() == [
        "tensorboard-blocked: 5 error(s); it lacks the reports of steps 2, 4, 6 and the tables of steps 2, 4, 6 "
        "and the plot (results.jsonl has them)"]  # one per send and one at finish
    assert delivery.errors == {"tensorboard-blocked": 5, "tensorboard": 0}
    assert delivery.finish() == delivery.lines  # once: the same lines, nothing tried again
    assert delivery.errors == {"tensorboard-blocked": 5, "tensorboard": 0}
    with pytest.raises(RuntimeError, match="this Delivery has finished"):
        delivery.send(8, *report_payload(8))
    assert scalars(read_events(tmp_path / "good")) == expected_scalars((2, 4, 6))


def test_a_long_outage_is_summed_up_by_its_first_and_last_steps(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    delivery = Delivery([TensorBoardTracker(blocked)], lambda _: None)
    for step in range(1, 11):
        delivery.send(step, report_payload(step)[0])  # no table
    assert delivery.finish() == ["tensorboard: 11 error(s); it lacks the reports of steps 1, 2, 3, ..., 9, 10 "
                                 "(results.jsonl has them)"]


def test_wrong_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="log_dir must be a folder's path"):
        TensorBoardTracker("")
    with pytest.raises(TypeError, match="each needs name, log_metrics"):
        Delivery([object()], print)
    with pytest.raises(ValueError, match="two have one name"):
        Delivery([TensorBoardTracker(tmp_path / "a"), TensorBoardTracker(tmp_path / "b")], print)
