"""The demo, run as a user runs it: one line per report with the stop's verdict, the full table once at
the end, no line that is not its own, and a picture that reads at a glance (one stop step throughout, the monitored panel marked, the grace
period shaded, the stop's projection drawn, a layout a laptop screen shows whole)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from dflash_callbacks.engine.stop import fit_projection, projected_value
from dflash_callbacks.callbacks.schema import build_stop_callback
from dflash_callbacks.demos.settings import demo_config
from dflash_callbacks.engine.live_tau_plot import draw_tau, live_tau_figure
from dflash_callbacks.scoring.report import EvalReport, read_results

from runs import DEADLINE
from suite_paths import REPO

MAX_STEPS = 400


OWN_LINES = re.compile("|".join([  # what the demo itself says, and nothing else
    r"step +\d+ \| .*",  # a report
    r"live tau \(tokens per target forward, .*", r"\|.*\|", r"\S+ live: .* of the baseline, .*",  # the table
    r"trained \d+ of \d+ steps in \d+ s; \d+ reports in \S+", r"live tau curves: \S+",  # the end
    r"dflash: .*", r"demo: .*",  # the library's lines, and the demo's while it builds its world
]))


@pytest.fixture(scope="module")
def demo_run(toy_cache_dir, toy_training_cache_dir, tmp_path_factory):
    """A short demo on the session's toy caches, run as a user runs it (`python -m dflash_callbacks.cli demo`,
    without a terminal, W&B offline): reports every 10 steps, judged from step 20, a stop after 2 trailing
    reports (a threshold of the baseline + 0.5 on the point values: the stop is certain, whenever the reports
    arrive; three tasks can not resolve it with intervals). Returns (its config, its summary read back from
    its last lines, the lines it printed, the lines it wrote to stderr)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    shutil.copytree(toy_training_cache_dir, out / "world" / "train-32x128")
    overrides = [f"out={out}", "wandb=offline", f"eval.cache={toy_cache_dir}", "train.sequences=32",
                 "train.seq_len=128", f"train.max_steps={MAX_STEPS}", "eval.every_n_train_steps=10",
                 "eval.max_pending=8", "eval.scoring.tasks=[fizzbuzz,trie,lru_cache]", "stop.grace_steps=20",
                 "stop.patience=2", "stop.min_ratio=null", "stop.min_delta=0.5", "stop.confidence=null"]
    run = subprocess.run([sys.executable, "-m", "dflash_callbacks.cli", "demo", *overrides], cwd=REPO,
                         capture_output=True, text=True, timeout=DEADLINE)
    print(run.stdout, run.stderr, sep="\n")  # shown when a test fails
    assert run.returncode == 0, run.stderr[-4000:]
    printed = run.stdout.splitlines()
    trained = re.fullmatch(r"trained (\d+) of \d+ steps in (\d+) s; \d+ reports in (\S+)", printed[-3])
    stops = [int(line.split()[1]) for line in printed if line.endswith(": stop") and re.match(r"step +\d+ \| ", line)]
    summary = {"steps": int(trained[1]), "seconds": int(trained[2]), "results": trained[3], "stop_reason": printed[-2],
               "plot": printed[-1].removeprefix("live tau curves: "), "stop_step": stops[0] if stops else None}
    return demo_config(overrides), summary, printed, run.stderr.splitlines()


def test_the_demo_prints_a_line_per_report_and_the_table_once(demo_run):
    cfg, summary, printed, _ = demo_run
    reports = read_results(Path(summary["results"])).reports
    stop_step = summary["stop_step"]
    assert stop_step == 30 and summary["steps"] < MAX_STEPS  # the third report: 20 and 30 trail, 10 is in the grace period
    lines = [line for line in printed if re.match(r"step +\d+ \| ", line)]
    assert [int(line.split()[1]) for line in lines] == [r.step for r in reports]
    for line, report in zip(lines, reports):
        monitored = report.value("ddtree@8/live")
        assert line.startswith(f"step {report.step:>4} | ddtree@8 {monitored:.2f} = "), line
        assert f"| vanilla {report.value('vanilla/live'):.2f}  ddtree@4 " in line, line
        verdict = line.rsplit(" | ", 1)[1]
        if report.step < 20:
            assert verdict == "grace period (judged from step 20)"
        elif report.step < stop_step:
            assert verdict == "trailing 1/2"
        elif report.step == stop_step:
            assert re.fullmatch(rf"trailing 2/2, projected \d+\.\d\d by step {MAX_STEPS}: stop", verdict), verdict
        else:
            assert verdict == "scored after the stop"
    tables = [i for i, line in enumerate(printed) if line.startswith("| task |")]
    assert len(tables) == 1 and tables[0] > printed.index(lines[-1])  # the full table, once, at the end
    assert f", step {reports[-1].step};" in printed[tables[0] - 1]  # the title: the last report, its intervals
    assert printed[-3].startswith(f"trained {summary['steps']} of {MAX_STEPS} steps in ")
    assert printed[-3].endswith(f"; {len(reports)} reports in {summary['results']}")
    assert summary["stop_reason"].startswith(f"dflash: stopping at step {stop_step}: ddtree@8/live ")
    assert Path(summary["plot"]) == Path(cfg.out) / "live_tau.png"

    # the PNG: a laptop screen shows it whole, and it is not a strip
    height, width = matplotlib.image.imread(summary["plot"]).shape[:2]
    assert width <= 1400 and height <= 900 and height >= 0.5 * width, (width, height)


def test_the_demo_says_only_its_own_lines(demo_run):
    """No progress bar left behind without a terminal, no third-party warning or tip a user can not act on
    (Lightning's devices and logging interval, W&B's setup, deprecations): every line, on stdout and on
    stderr, is the demo's own or the library's; what it reports (a line per report, the table, the stop) on
    stdout, once."""
    _, summary, printed, errors = demo_run
    theirs = [line for line in printed + errors if line.strip() and not OWN_LINES.fullmatch(line)]
    assert not theirs, theirs
    assert all(line.startswith(("dflash: ", "demo: ")) for line in errors), errors
    # its report on stdout, once: the stop's line beside its table (it came on stderr too)
    assert [line for line in printed + errors if "stopping at step" in line] == [summary["stop_reason"]]
    assert any(line.startswith("| task |") for line in printed) and not any("| task |" in line for line in errors)


def test_the_toy_world_builds_without_a_progress_bar_when_there_is_no_terminal(tmp_path):
    """The demo's first run writes its training text (the toy target's answers): one line saying so, no
    progress bar (transformers' weight loading drew one per load, to a log as to a terminal)."""
    code = ("import sys; from pathlib import Path; from dflash_callbacks.demos.demo import demo_output, training_data; "
            "from dflash_callbacks.demos.settings import TrainConfig\n"
            "with demo_output(): training_data(Path(sys.argv[1]), TrainConfig(sequences=2, seq_len=80))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "world")], cwd=REPO, capture_output=True,
                         text=True, timeout=DEADLINE)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.splitlines() == [f"demo: writing the training text (2 answers of the toy target) to "
                                       f"{tmp_path / 'world' / 'train-2x80'} (once)"]
    assert run.stderr == "", run.stderr
    assert (tmp_path / "world" / "train-2x80" / "manifest.json").is_file()


def test_the_picture_reads_at_a_glance(demo_run):
    cfg, summary, _, _ = demo_run
    reports = read_results(Path(summary["results"])).reports
    (base_file,) = Path(cfg.out).glob("baseline-reports/baseline-*.json")
    baseline = EvalReport.load(base_file)
    stop = build_stop_callback(cfg.stop)
    reason = "stopped at step 30: ddtree@8/live ... < baseline + 0.5"
    fig = live_tau_figure(reports, baseline, title="demo", stop=stop, stop_step=30, stop_reason=reason,
                          horizon=MAX_STEPS)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["vanilla", "ddtree@4", "ddtree@8: monitored by the stop", "top@4"]
    monitored = axes[2]
    assert all(spine.get_linewidth() == 2 for spine in monitored.spines.values())

    # one stop step: the title, and a line at step 30 on every panel, named the same
    texts = [fig.get_suptitle()] + [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert {int(s) for text in texts for s in re.findall(r"stop\w* at step (\d+)", text)} == {30}
    for ax in axes:
        (stop_line,) = [line for line in ax.get_lines() if line.get_label() == "stopped at step 30"]
        assert list(stop_line.get_xdata()) == [30, 30]

    # the grace period, shaded from 0 to grace_steps on the monitored panel only
    def grace(ax):
        return [p for p in ax.patches if p.get_label().startswith("grace period")]

    (span,) = grace(monitored)
    assert (span.get_x(), span.get_x() + span.get_width()) == (0, 20) and not any(grace(ax) for ax in axes if ax is not monitored)

    # the stop's projection, from the reports it fitted (the last 5 up to step 30) out to the last step
    (projection,) = [line for line in monitored.get_lines() if line.get_label().startswith("projection a+b*log(step)")]
    judged = {r.step: r.value("ddtree@8/live") for r in reports if r.step <= 30}
    a, b = fit_projection(list(judged), list(judged.values()))
    xs, ys = projection.get_xdata(), projection.get_ydata()
    assert (xs[0], xs[-1]) == (10, MAX_STEPS) and monitored.get_xlim()[1] >= MAX_STEPS
    assert all(abs(y - projected_value(a, b, x)) < 1e-9 for x, y in zip(xs, ys))
    assert f"({projected_value(a, b, MAX_STEPS):.2f} at step {MAX_STEPS})" in projection.get_label()
    threshold = [line for line in monitored.get_lines() if line.get_label().startswith("stop threshold")]
    assert threshold and threshold[0].get_ydata()[0] == pytest.approx(baseline.value("ddtree@8/live") + 0.5)

    # legible: one legend, in 10-point type; a figure about 1100 px wide at the saved 100 dpi
    assert len(fig.legends) == 1 and all(t.get_fontsize() >= 10 for t in fig.legends[0].get_texts())
    assert 1000 <= fig.get_figwidth() * 100 <= 1400


def test_a_line_takes_an_interval_band():
    """The place an interval per number goes: lo/hi shade around the line."""
    ax = Figure().subplots()
    draw_tau(ax, [10, 20], [1.5, 1.7], label="ours", color="tab:blue")
    assert not any(isinstance(c, PolyCollection) for c in ax.collections)
    draw_tau(ax, [10, 20], [1.5, 1.7], lo=[1.4, 1.6], hi=[1.6, 1.8], label="ours", color="tab:blue")
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert band.get_paths()[0].get_extents().bounds == pytest.approx((10, 1.4, 10, 0.4))
