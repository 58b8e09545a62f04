"""`dflash-callbacks demo`: train a toy drafter on the CPU with both callbacks attached.

The toy world (`dflash_callbacks.demos.toy`) gives a tiny real Qwen3 target trained on
the Python standard library. The demo
1. builds (once, cached under `OUT/world/`) the coding10 cache of that target and a
   cache of training text (the target's own greedy continuations of code snippets);
2. uses the toy baseline drafter shipped in the package (`tools/train_toy_baseline.py`);
3. trains a new drafter with a deliberately weak recipe (one layer, a low learning
   rate), with DrafterEvalCallback scoring snapshots in the background and
   TrailingBaselineStop stopping the run once it keeps trailing the baseline;
4. prints one line per report (the monitored method against the baseline, the other
   methods, and the stop's verdict) and the full table of the last report at the end, logs
   to W&B (offline by default) and to CSV, and writes `OUT/live_tau.png`: live tau of ours
   against the baseline per method, the monitored panel marked with the stop threshold,
   the grace period and the projection, and the step of the report the stop acted on.

Every setting is checked before anything is built or written (`check_demo`): a mistake costs
no time and leaves nothing under `out`.

Its settings are conf/demo.yaml over the callbacks' defaults; any key can be overridden
as `key=value` (e.g. `train.max_steps=300`, `eval.every_n_train_steps=25`, `stop.patience=2`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..callbacks import TrailingBaselineStop
from ..callbacks.schema import build_eval_callback, build_stop_callback
from ..scoring.intervals import paired_comparison
from ..scoring.methods import Monitor
from ..engine.results_line import final_table
from ..scoring.report import EvalReport, family_title
from ..engine.live_tau_plot import plot_live_tau
from .toy.threads import torch_threads
from .settings import DemoConfig, TrainConfig, check_demo, demo_config  # noqa: F401  (the demo's settings)


def training_data(world: Path, train: TrainConfig):
    from torch.utils.data import DataLoader

    from .training import CacheSequences, collate_sequences
    from .toy.world import build_toy_training_cache

    folder = world / f"train-{train.sequences}x{train.seq_len}"
    if not (folder / "manifest.json").is_file():
        print(f"demo: writing the training text ({train.sequences} answers of the toy target) to {folder} (once)",
              flush=True)
    build_toy_training_cache(folder, n_sequences=train.sequences, seq_len=train.seq_len, progress=sys.stderr.isatty())
    data = CacheSequences(folder)
    return DataLoader(data, batch_size=train.batch_size, shuffle=True, collate_fn=collate_sequences,
                      generator=torch.Generator().manual_seed(train.seed), num_workers=0)


def toy_module(train: TrainConfig):
    from .training import DFlashTrainingModule
    from .toy.world import toy_drafter_config, toy_target_path

    torch.manual_seed(train.seed)
    config = toy_drafter_config(block_size=train.block_size, num_layers=train.layers)
    return DFlashTrainingModule(config, toy_target_path(), lr=train.lr, blocks_per_sequence=train.blocks_per_sequence,
                                seed=train.seed)


def resolve_world(cfg: DemoConfig) -> tuple[str, str, str | None]:
    """Fill in `toy` for the cache, target and baseline."""
    from .toy.world import build_toy_cache, toy_baseline_path, toy_target_path

    world = Path(cfg.out) / "world"
    target = str(toy_target_path()) if cfg.eval.target == "toy" else cfg.eval.target
    cache = cfg.eval.cache
    if cache == "toy":
        cache = str(world / f"coding10-b{cfg.train.block_size}")
        if not (Path(cache) / "manifest.json").is_file():
            print(f"demo: building the toy target's coding10 cache in {cache} (once)", flush=True)
            build_toy_cache(cache, block_size=cfg.train.block_size, progress=sys.stderr.isatty())
    baseline = str(toy_baseline_path()) if cfg.eval.baseline == "toy" else cfg.eval.baseline
    return cache, target, baseline


class ReportLines:
    """One line per report: the monitored method against the baseline, the other methods, and the
    stop's verdict (subscribers hear of a report after the stops have judged it); and the step of
    the report the stop stopped training at, with its reason."""

    def __init__(self, stop: TrailingBaselineStop | None, horizon: int):
        self.stop, self.horizon = stop, horizon
        self.stop_step: int | None = None  # the report the stop acted on
        self.stop_reason: str | None = None  # ... and why
        self._judged = None  # the stop's last decision, to tell a new one from the one before

    def show(self, report: EvalReport, baseline: EvalReport | None) -> None:
        print(report_line(report, baseline, self.stop, self.verdict(report)), flush=True)

    def verdict(self, report: EvalReport) -> str:
        """The stop's verdict on `report`, in a few words."""
        stop = self.stop
        if stop is None:
            return ""
        if self.stop_step is not None:
            return "scored after the stop"
        decision, fresh = stop.last_decision, stop.last_decision is not self._judged
        self._judged = decision
        if not fresh:  # no baseline (or not a finite one) to judge against
            return "not judged"
        if report.step < stop.grace_steps:
            return f"grace period (judged from step {stop.grace_steps})"
        if not decision.stop:
            return f"trailing {decision.wait_count}/{stop.patience}" if decision.wait_count else "not trailing"
        projected = f", projected {decision.projected:.2f} by step {self.horizon}" if decision.projected is not None else ""
        said = f"trailing {decision.wait_count}/{stop.patience}{projected}"
        if stop.action == "warn":
            return f"{said}: would stop, but action='warn'"
        if stop.stop_reason is not None:  # the stop gives its reason at once only when it does not act
            return f"{said}: would stop, but training ends anyway"
        self.stop_step, self.stop_reason = report.step, decision.reason
        return f"{said}: stop"


def report_line(report: EvalReport, baseline: EvalReport | None, stop: TrailingBaselineStop | None, verdict: str) -> str:
    """`step  250 | ddtree@8 1.45 = 62% of the baseline's 2.36 | vanilla 1.19  ddtree@4 1.31 | trailing 1/3`:
    the monitored number first, then every other method's live tau. A baseline of another family than ours is
    named with each side's (`DFlash 2 ddtree@8 1.45 = 62% of the DFlash baseline's 2.36`)."""
    monitor = Monitor.parse(stop.monitor) if stop is not None else None
    parts = [f"step {report.step:>4}"]
    ours_family = theirs_family = ""
    if baseline is not None and family_title(report) != family_title(baseline):
        ours_family, theirs_family = f"{family_title(report)} ", f"{family_title(baseline)} "
    if monitor is not None:
        ours = report.value(monitor)
        text = f"{ours_family}{monitor.method if monitor.aggregate == 'live' else monitor} {ours:.2f}"
        if baseline is not None and str(monitor.method) in baseline.methods:
            if report.intervals is not None and baseline.intervals is not None:
                ratio = paired_comparison(report, baseline)[str(monitor)]["mean"]
                text += f" = {ratio.ratio.show(percent=True)} of the {theirs_family}baseline's " \
                        f"{baseline.value(monitor):.2f}, {ratio.verdict}"
            else:
                text += f" = {ours / baseline.value(monitor):.0%} of the {theirs_family}baseline's " \
                        f"{baseline.value(monitor):.2f}"
        parts.append(text)
    others = [m for m in report.methods if monitor is None or m != str(monitor.method)]
    parts.append("  ".join(f"{m} {report.value(f'{m}/live'):.2f}" for m in others))
    return " | ".join(parts + ([verdict] if verdict else []))


def run_demo(cfg: DemoConfig) -> dict:
    check_demo(cfg)
    with torch_threads(1), demo_output(said=(f"{cfg.eval.name}: stopping at step ",)):  # toy models: one intra-op
        # thread for training, one core left for scoring
        return _run_demo(cfg)


@contextmanager
def demo_output(said: tuple[str, ...] = ()) -> Iterator[None]:
    """Around the demo only, its output is its own: the third-party lines a user can not act on are not
    printed (Lightning's device lines and tips, deprecation warnings), nor the library's lines the demo says
    itself on stdout (`said`: their beginnings; the stop's decision), a warning is one line, and without a
    terminal, no progress bar (transformers' weight loading; the demo's own bars are off there too)."""
    import lightning
    import transformers.utils.logging as transformers_logging

    lightning_info = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # this library's lines go there too
    own = LightningsOwnLines(lightning.__path__[0], said)
    bars = transformers_logging.is_progress_bar_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.showwarning = lambda message, *args, **kwargs: print(f"warning: {message}", file=sys.stderr, flush=True)
        lightning_info.addFilter(own)
        if not sys.stderr.isatty():
            transformers_logging.disable_progress_bar()
        try:
            yield
        finally:
            lightning_info.removeFilter(own)
            if bars:
                transformers_logging.enable_progress_bar()


class LightningsOwnLines(logging.Filter):
    """Drops the info lines Lightning itself says (a record names where `rank_zero_info` was called), and those
    beginning with one of `said` (what the demo prints itself)."""

    def __init__(self, folder: str, said: tuple[str, ...] = ()):
        super().__init__()
        self.folder, self.said = os.path.join(folder, ""), said

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        return not record.pathname.startswith(self.folder) and not record.getMessage().startswith(self.said)


def _run_demo(cfg: DemoConfig) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    os.environ.setdefault("WANDB_SILENT", "true")  # the lines printed here say it all
    started = time.time()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    evaluation = dataclasses.replace(cfg.eval)
    evaluation.cache, evaluation.target, evaluation.baseline = resolve_world(cfg)
    evaluation.dirpath = evaluation.dirpath or str(out / "dflash")
    evaluation.baseline_cache_dir = evaluation.baseline_cache_dir or str(out / "baseline-reports")
    eval_cb, stop_cb = build_eval_callback(evaluation), build_stop_callback(cfg.stop)
    lines = ReportLines(stop_cb, cfg.train.max_steps)
    eval_cb.subscribe(lines.show)
    loggers = [CSVLogger(out, name="csv")]
    if cfg.wandb != "disabled":
        import wandb
        from lightning.pytorch.loggers import WandbLogger

        # the run made here, not by the logger (whose settings W&B warns about at every start)
        loggers.append(WandbLogger(experiment=wandb.init(project=cfg.wandb_project, dir=str(out), mode=cfg.wandb)))
    data = training_data(out / "world", cfg.train)
    trainer = pl.Trainer(
        max_steps=cfg.train.max_steps, max_epochs=-(-cfg.train.max_steps // len(data)),  # "Epoch 4/9", not "4/-2"
        accelerator="cpu", logger=loggers,
        callbacks=[eval_cb] + ([stop_cb] if stop_cb else []), enable_checkpointing=False,
        enable_model_summary=False, default_root_dir=str(out),
        log_every_n_steps=min(10, len(data)),  # Lightning warns of an interval longer than an epoch
        enable_progress_bar=sys.stderr.isatty(),  # else its last state is left among the demo's lines
    )
    trainer.fit(toy_module(cfg.train), data)
    if cfg.wandb != "disabled":
        import wandb

        wandb.finish()
    summary = {
        "steps": trainer.global_step, "max_steps": cfg.train.max_steps, "run": eval_cb.run_id,
        "reports": [r.step for r in eval_cb.reports], "stop_reason": getattr(stop_cb, "stop_reason", None),
        "stop_step": lines.stop_step, "seconds": time.time() - started, "results": str(eval_cb.run.results_path),
        "errors": eval_cb.errors,
    }
    if eval_cb.reports:
        print(final_table(eval_cb.reports, eval_cb.baseline_report))
        title = f"demo run {eval_cb.run_id}: live tau of ours against the baseline ({len(eval_cb.reports)} reports)"
        reason = f"stopped at step {lines.stop_step}: {lines.stop_reason}" if lines.stop_step is not None else None
        summary["plot"] = str(plot_live_tau(eval_cb.reports, eval_cb.baseline_report, out / "live_tau.png", title=title,
                                            stop=stop_cb, stop_step=lines.stop_step, stop_reason=reason,
                                            horizon=cfg.train.max_steps))
    print(f"trained {summary['steps']} of {cfg.train.max_steps} steps in {summary['seconds']:.0f} s; "
          f"{len(eval_cb.reports)} reports in {summary['results']}")
    if summary["stop_reason"]:
        print(summary["stop_reason"])
    if "plot" in summary:
        print(f"live tau curves: {summary['plot']}")
    return summary
