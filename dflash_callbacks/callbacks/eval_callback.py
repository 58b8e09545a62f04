"""DrafterEvalCallback: score the live drafter against a baseline while training runs.

On the training thread it only starts weight copies and drains finished reports:

    on_train_batch_end, step % every_n_train_steps == 0:
        rank 0 starts a copy of the drafter's weights (snapshot.capture) and submits
        it to the runner (a thread, a spawned process, or an external watcher)
    on_before_optimizer_step:
        wait for that copy, so the weights scored are those of the captured step
    on_train_batch_end (every step, rank 0):
        for each finished report: append it to results.jsonl, then log it at the
        snapshot's step to every logger, put the means in trainer.callback_metrics,
        and hand it to subscribers (callbacks with `on_dflash_report`, functions
        passed to `subscribe`)

A failure in snapshotting or scoring is a warning and an error count, unless
`on_error="raise"`. Nothing is scored twice: steps already in results.jsonl (or in
the restored state) are not snapshotted again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from ..cache.format import HiddenStateCache
from ..logging import report_metrics, table_columns, table_rows, wandb_define_metrics
from ..model import DrafterConfig, DFlashDrafter
from ..model.drafter import check_state_dict
from ..model.target_head import EMBED_KEYS, locate_keys
from ..scoring.config import ScoringConfig
from ..scoring.report import EvalReport, comparable
from .evaluator import EvaluatorSpec
from .runners import BASELINE, RUNNERS, BackgroundRunner, Outcome
from .snapshot import capture, is_sharded

BUSY_POLICIES = ("skip", "queue")
ON_ERROR = ("warn", "raise")
RESULTS_FILE = "results.jsonl"


def resolve_drafter(pl_module: nn.Module, drafter: str | Callable) -> nn.Module:
    if callable(drafter):
        module = drafter(pl_module)
    else:
        module = pl_module
        for part in drafter.split("."):
            if not hasattr(module, part):
                raise AttributeError(
                    f"DrafterEvalCallback(drafter={drafter!r}): {type(module).__name__} has no attribute {part!r}; "
                    "pass the attribute path of the drafter or a function module -> drafter"
                )
            module = getattr(module, part)
    if not isinstance(module, nn.Module):
        raise TypeError(f"the drafter must be an nn.Module; got {type(module).__name__}")
    return module


def drafter_config_of(module: nn.Module, given: DrafterConfig | str | os.PathLike | None) -> DrafterConfig:
    if isinstance(given, DrafterConfig):
        return given
    if given is not None:
        return DrafterConfig.from_file(given)
    config = getattr(module, "config", None)
    if isinstance(config, DrafterConfig):
        return config
    if hasattr(config, "to_dict"):  # a transformers config of the published model class
        return DrafterConfig.from_dict(config.to_dict())
    raise ValueError("the drafter has no DrafterConfig at .config; pass drafter_config=DrafterConfig or a config.json path")


def read_results(path: Path) -> list[dict]:
    """Every complete line of results.jsonl (a torn last line from a crash is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def repair_results(path: Path) -> None:
    """Cut a torn last line (a crash in the middle of an append) off results.jsonl, so the
    next append starts on a line of its own and every line stays parseable."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    rank_zero_warn(f"dflash: {path} ended in a torn line (a crash while appending); dropped its {len(data) - keep} "
                   "bytes")


def append_result(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


class DrafterEvalCallback(Callback):
    """Snapshot the drafter every `every_n_train_steps` steps and score it in the background.

    Args:
        cache: hidden-state cache folder (`dflash-callbacks extract`).
        target: the target's folder; only `embed_tokens` and `lm_head` are read.
        baseline: a published drafter folder (scored once, cached) or a saved report JSON.
        every_n_train_steps: snapshot cadence in optimizer steps (>= 1).
        drafter: attribute path on the LightningModule, or a function module -> drafter.
        drafter_config: a DrafterConfig or config.json path, when the drafter has none at `.config`.
        scoring: a ScoringConfig or a dict of its fields (methods, budgets, window, ...).
        runner: "thread" | "process" | "external".
        device: where scoring runs ("auto": cuda when available); overrides scoring.device.
        busy: "skip" (no new snapshot while one is pending) or "queue" (up to `max_pending`).
        keep_last: snapshots kept on disk (0: none written; not with runner process/external).
        on_error: "warn" (training goes on) or "raise".
        wait_on_end: score and log the last step before `fit` returns.
        dirpath: where snapshots, reports and results.jsonl go (default: <default_root_dir>/dflash).
        baseline_cache_dir: where baseline reports are cached across runs.
        verbose: print a one-line summary per report.
    """

    def __init__(
        self,
        cache: str | os.PathLike,
        target: str | os.PathLike,
        baseline: str | os.PathLike | None = None,
        every_n_train_steps: int = 500,
        drafter: str | Callable[[pl.LightningModule], nn.Module] = "drafter",
        drafter_config: DrafterConfig | str | os.PathLike | None = None,
        scoring: ScoringConfig | dict | None = None,
        runner: str = "thread",
        device: str | None = None,
        busy: str = "skip",
        max_pending: int = 1,
        keep_last: int = 2,
        on_error: str = "warn",
        wait_on_end: bool = True,
        dirpath: str | os.PathLike | None = None,
        baseline_cache_dir: str | os.PathLike | None = None,
        wait_timeout: float = 3600.0,
        verbose: bool = True,
    ):
        super().__init__()
        if isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) or every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be an integer >= 1; got {every_n_train_steps!r}")
        for name, value, legal in (("runner", runner, RUNNERS), ("busy", busy, BUSY_POLICIES), ("on_error", on_error, ON_ERROR)):
            if value not in legal:
                raise ValueError(f"{name} must be one of {list(legal)}; got {value!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an integer >= 1; got {max_pending!r}")
        if not isinstance(keep_last, int) or keep_last < 0:
            raise ValueError(f"keep_last must be an integer >= 0; got {keep_last!r}")
        if keep_last == 0 and runner != "thread":
            raise ValueError(f"runner={runner!r} reads snapshots from disk, so keep_last must be >= 1")
        if not (isinstance(drafter, str) or callable(drafter)):
            raise TypeError("drafter must be an attribute name or a function LightningModule -> drafter")
        scoring = scoring if isinstance(scoring, ScoringConfig) else ScoringConfig(**(scoring or {}))
        if device is not None:
            scoring.device = device
            scoring.__post_init__()
        self.cache, self.target = Path(cache), Path(target)
        self.baseline_source = None if baseline is None else Path(baseline)
        self.every_n_train_steps = every_n_train_steps
        self.drafter, self.drafter_config = drafter, drafter_config
        self.scoring, self.runner_kind, self.busy, self.max_pending = scoring, runner, busy, max_pending
        self.keep_last, self.on_error, self.wait_on_end = keep_last, on_error, wait_on_end
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.baseline_cache_dir = baseline_cache_dir
        self.wait_timeout, self.verbose = wait_timeout, verbose

        self.history: list[dict] = []  # {"step", "mean": {method: {agg: value}}}
        self.last_scored_step: int | None = None
        self.baseline_summary: dict | None = None
        self.errors = 0
        self.skipped = 0
        self.baseline_report: EvalReport | None = None
        self.reports: list[EvalReport] = []  # reports of this process, in arrival order
        self._subscribers: list[Callable] = []
        self._runner: BackgroundRunner | None = None
        self._staging = None
        self._last_capture_step: int | None = None
        self._last_taken_step: int | None = None  # last step actually snapshotted (not skipped)
        self._scored: set[int] = set()
        self._wandb_defined: set[int] = set()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(cache=str(self.cache), every_n_train_steps=self.every_n_train_steps)

    def subscribe(self, fn: Callable[[EvalReport, EvalReport | None], Any]) -> None:
        """Call `fn(report, baseline)` on the training thread for every new report."""
        self._subscribers.append(fn)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        module = resolve_drafter(pl_module, self.drafter)
        config = drafter_config_of(module, self.drafter_config)
        self._config = config
        self._check_inputs(module, config)
        self.run_dir = self.dirpath or Path(trainer.default_root_dir) / "dflash"
        self.results_path = self.run_dir / RESULTS_FILE
        if not trainer.is_global_zero:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        repair_results(self.results_path)
        for record in read_results(self.results_path):
            if record.get("step") is not None and "tasks" in record:
                self._remember(EvalReport.from_dict(record))
        spec = EvaluatorSpec(
            cache=str(self.cache), target=str(self.target),
            baseline=None if self.baseline_source is None else str(self.baseline_source),
            scoring=self.scoring.to_dict(),
            baseline_cache_dir=None if self.baseline_cache_dir is None else str(self.baseline_cache_dir),
        )
        self._runner = BackgroundRunner(self.runner_kind, spec, self.run_dir, self.keep_last)

    def _check_inputs(self, module: nn.Module, config: DrafterConfig) -> None:
        """Everything that can be checked before training starts is checked here."""
        with torch.device("meta"):
            expected = DFlashDrafter(config).state_dict()
        check_state_dict(expected, module.state_dict())
        cache = HiddenStateCache(self.cache)
        cache.check_compatible(config, block_size=self.scoring.block_size)
        block = self.scoring.block_size or config.block_size
        unknown = sorted(set(self.scoring.tasks or []) - set(cache.task_names))
        if unknown:
            raise ValueError(f"scoring.tasks {unknown} are not in the cache {self.cache}; it holds {cache.task_names}")
        if not any(key in locate_keys(self.target) for key in EMBED_KEYS):
            raise ValueError(f"target {self.target} holds no input embedding; looked for {list(EMBED_KEYS)}")
        if self.baseline_source is not None and not self.baseline_source.exists():
            raise FileNotFoundError(f"baseline {self.baseline_source} does not exist (a drafter folder or a report JSON)")
        if block < 2:
            raise ValueError(f"block size {block} is too small to draft anything")
        # A block drafts block-1 tokens; the deepest depth is only measured where an anchor has
        # block-1 labels after it, i.e. a completion of at least `block` tokens (anchor P).
        entries = [cache.entry(n) for n in self.scoring.tasks or cache.task_names]
        lengths = {e["name"]: e["num_tokens"] - e["prompt_len"] for e in entries}
        if not lengths:
            raise ValueError(f"the cache {self.cache} holds no task to score")
        longest = max(lengths, key=lengths.get)
        if block > lengths[longest]:
            raise ValueError(
                f"block size {block} is larger than the cache {self.cache} allows: a block drafts {block - 1} tokens, "
                f"but the longest completion ({longest!r}, {lengths[longest]} tokens) has labels for at most "
                f"{lengths[longest] - 1}; use a block size <= {lengths[longest]} or a cache with longer completions"
            )

    # ------------------------------------------------------------------ training hooks
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._drain(trainer, pl_module)
        step = trainer.global_step
        if step > 0 and step % self.every_n_train_steps == 0 and step != self._last_capture_step:
            self._snapshot(trainer, pl_module, step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._staging is not None:
            self._staging.wait()
            self._staging = None

    def on_train_end(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if self.wait_on_end and step > 0 and step != self._last_taken_step:  # also when skipped while busy
            self._snapshot(trainer, pl_module, step, force=True)  # every rank: a sharded gather is collective
        if self._runner is None:
            return
        if self.wait_on_end:
            self._runner.close(wait=True, timeout=self.wait_timeout)
            self._runner.wait_external(self.wait_timeout)
        else:
            self._runner.close(wait=False)
        self._drain(trainer, pl_module)
        self._runner = None

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._runner is not None:
            self._runner.close(wait=False)
            self._runner = None

    # ------------------------------------------------------------------ snapshots
    def _snapshot(self, trainer, pl_module, step: int, force: bool = False) -> None:
        """Rank 0 decides whether to snapshot; with sharded (FSDP) weights every rank
        takes part in the gather, so the decision is broadcast first."""
        self._last_capture_step = step
        module = resolve_drafter(pl_module, self.drafter)
        skip = False
        if trainer.is_global_zero:
            skip = step in self._scored  # scored before a resume
            if not skip and not force and self._runner.pending >= (1 if self.busy == "skip" else self.max_pending):
                self.skipped += 1
                skip = True
        sharded = is_sharded(module)
        if sharded and trainer.world_size > 1:
            skip = trainer.strategy.broadcast(skip, src=0)
        if not skip:
            self._last_taken_step = step
        if skip or not (trainer.is_global_zero or sharded):
            return
        try:
            snapshot = capture(module, self._config, step, trainer.current_epoch, is_rank_zero=trainer.is_global_zero)
        except Exception as e:
            self._fail(trainer, step, f"taking the snapshot failed: {type(e).__name__}: {e}")
            return
        if snapshot is not None:
            self._staging = snapshot
            self._runner.submit(snapshot)

    # ------------------------------------------------------------------ reports
    def _drain(self, trainer, pl_module) -> None:
        if self._runner is None:
            return
        for outcome in self._runner.poll():
            self._handle(trainer, pl_module, outcome)

    def _handle(self, trainer, pl_module, outcome: Outcome) -> None:
        if outcome.error is not None:
            what = "scoring the baseline" if outcome.step == BASELINE else f"step {outcome.step}"
            if outcome.step != BASELINE:
                append_result(self.results_path, {"step": outcome.step, "error": outcome.error, "time": time.time()})
            self._fail(trainer, outcome.step, f"{what} failed: {outcome.error}")
            return
        report = outcome.report
        if outcome.step == BASELINE:
            self.baseline_report = report
            self.baseline_summary = report.mean if report is not None else None
            return
        if report.step in self._scored:
            return
        if self.baseline_report is not None:
            for problem in comparable(report, self.baseline_report):
                rank_zero_warn(f"dflash: ours and the baseline differ: {problem}")
        record = report.to_dict()
        record["score_seconds"] = outcome.seconds
        append_result(self.results_path, record)  # before logging: a crash loses nothing
        self._remember(report)
        self.reports.append(report)
        self._log(trainer, report, outcome.seconds)
        for callback in trainer.callbacks:
            if callback is not self and hasattr(callback, "on_dflash_report"):
                callback.on_dflash_report(trainer, pl_module, report, self.baseline_report)
        for fn in self._subscribers:
            fn(report, self.baseline_report)

    def _remember(self, report: EvalReport) -> None:
        self.history = [h for h in self.history if h["step"] != report.step] + [{"step": report.step, "mean": report.mean}]
        self.history.sort(key=lambda h: h["step"])
        self.last_scored_step = max(self.last_scored_step or 0, report.step)
        self._scored.add(report.step)

    def _fail(self, trainer, step: int, message: str) -> None:
        self.errors += 1
        if self.on_error == "raise":
            raise RuntimeError(f"dflash: {message}")
        rank_zero_warn(f"dflash: {message} (training goes on; errors so far: {self.errors})")
        for logger in trainer.loggers:
            try:
                logger.log_metrics({"dflash/errors": float(self.errors)}, step=trainer.global_step)
            except Exception:
                pass

    def _log(self, trainer, report: EvalReport, seconds: float) -> None:
        metrics = report_metrics(report, self.baseline_report)
        metrics.update({"dflash/step": float(report.step), "dflash/score_seconds": seconds, "dflash/errors": float(self.errors)})
        for key, value in metrics.items():
            if key.endswith("/mean"):
                trainer.callback_metrics[key] = torch.tensor(value)
        for logger in trainer.loggers:
            try:
                if type(logger).__name__ == "WandbLogger":
                    self._log_wandb(logger, report, metrics)
                else:
                    logger.log_metrics(metrics, step=report.step)
            except Exception as e:  # one broken logger must not cost the others their numbers
                rank_zero_warn(f"dflash: logging to {type(logger).__name__} failed: {type(e).__name__}: {e}")
        if self.verbose:
            rank_zero_info(self.summary_line(report))

    def _log_wandb(self, logger, report: EvalReport, metrics: dict) -> None:
        import wandb

        run = logger.experiment
        if id(run) not in self._wandb_defined:
            wandb_define_metrics(run, report, self.baseline_report)
            self._wandb_defined.add(id(run))
        table = wandb.Table(
            columns=table_columns(report, self.baseline_report), data=table_rows(report, self.baseline_report)
        )
        run.log({**metrics, "dflash/table": table, "trainer/global_step": report.step})

    def summary_line(self, report: EvalReport) -> str:
        parts = []
        for method in report.methods:
            ours = report.value(f"{method}/live")
            text = f"{method} {ours:.2f}"
            if self.baseline_report is not None and method in self.baseline_report.methods:
                base = self.baseline_report.value(f"{method}/live")
                text += f" (baseline {base:.2f}, {100 * ours / base:.0f}%)" if base else ""
            parts.append(text)
        return f"dflash step {report.step}: live tau " + ", ".join(parts)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [{"step": h["step"], "mean": h["mean"]} for h in self.history],
            "last_scored_step": self.last_scored_step,
            "baseline": self.baseline_summary,
            "errors": self.errors,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        by_step = {h["step"]: h for h in self.history}
        by_step.update({h["step"]: h for h in state_dict.get("history", [])})
        self.history = [by_step[s] for s in sorted(by_step)]
        self._scored.update(by_step)
        steps = [s for s in (self.last_scored_step, state_dict.get("last_scored_step")) if s is not None]
        self.last_scored_step = max(steps) if steps else None
        self.baseline_summary = state_dict.get("baseline") or self.baseline_summary
        self.errors = state_dict.get("errors", 0)
        self.skipped = state_dict.get("skipped", 0)


__all__ = ["DrafterEvalCallback", "read_results"]
