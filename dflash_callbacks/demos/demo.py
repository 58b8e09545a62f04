"""`dflash-callbacks demo`: train a toy drafter on the CPU with both callbacks attached.

The toy world (`dflash_callbacks.demos.toy`) gives a tiny real Qwen3 target trained on
the Python standard library. The demo
1. builds (once, cached under `OUT/world/`) the coding10 cache of that target and a
   cache of training text (the target's own greedy continuations of code snippets);
2. uses the toy baseline drafter shipped in the package (`tools/train_toy_baseline.py`);
3. trains a new drafter with a deliberately weak recipe (one layer, a low learning
   rate), with DrafterEvalCallback scoring snapshots in the background and
   TrailingBaselineStop stopping the run once it keeps trailing the baseline;
4. prints a table per report, logs to W&B (offline by default) and to CSV, and writes
   `OUT/live_tau.png`: live tau of ours against the baseline per method, with the stop
   threshold and the stop step.

Its settings are conf/demo.yaml over the callbacks' defaults; any key can be overridden
as `key=value` (e.g. `train.max_steps=300`, `eval.every_n_train_steps=25`, `stop.patience=2`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import EvalConfig, StopConfig, build_eval_callback, build_stop_callback, load_config
from ..paths import CONF_DIR
from ..scoring.report import EvalReport, comparison_table
from .toy.threads import torch_threads

DEMO_YAML = CONF_DIR / "demo.yaml"
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class TrainConfig:
    """A drafter training recipe on the toy world (the demo's: deliberately weak)."""

    max_steps: int = 600
    lr: float = 3e-4
    layers: int = 1
    block_size: int = 8
    blocks_per_sequence: int = 16
    batch_size: int = 4
    sequences: int = 256  # training sequences (target continuations of stdlib snippets)
    seq_len: int = 160
    seed: int = 0


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    wandb: str = "offline"  # offline | online | disabled
    wandb_project: str = "dflash-callbacks-demo"
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    stop: StopConfig = field(default_factory=StopConfig)


def demo_config(overrides: list[str] | tuple = ()) -> DemoConfig:
    """conf/demo.yaml over the defaults, then `key=value` overrides."""
    return load_config(DemoConfig, DEMO_YAML, overrides)


def config_keys(config: object = None, prefix: str = "") -> list[tuple[str, object]]:
    """Every key of a (nested) config dataclass with its value, for `demo --help`."""
    config = DemoConfig() if config is None else config
    keys = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            keys += config_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append((f"{prefix}{f.name}", value))
    return keys


def training_data(world: Path, train: TrainConfig):
    from torch.utils.data import DataLoader

    from ..training import CacheSequences, collate_sequences
    from .toy.world import build_toy_training_cache

    folder = world / f"train-{train.sequences}x{train.seq_len}"
    build_toy_training_cache(folder, n_sequences=train.sequences, seq_len=train.seq_len)
    data = CacheSequences(folder)
    return DataLoader(data, batch_size=train.batch_size, shuffle=True, collate_fn=collate_sequences,
                      generator=torch.Generator().manual_seed(train.seed), num_workers=0)


def toy_module(train: TrainConfig):
    from ..training import DFlashTrainingModule
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
            build_toy_cache(cache, block_size=cfg.train.block_size, progress=True)
    baseline = str(toy_baseline_path()) if cfg.eval.baseline == "toy" else cfg.eval.baseline
    return cache, target, baseline


def plot_live_tau(reports: list[EvalReport], baseline: EvalReport | None, path: Path, *, title: str,
                  stop=None) -> Path:
    """One panel per method, one y-scale: ours per report, the baseline, the stop threshold
    on the monitored method, and the step the run stopped at with its reason."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = reports[0].methods
    fig, axes = plt.subplots(1, len(methods), figsize=(4 * len(methods), 3.6), squeeze=False, sharey=True)
    steps = [r.step for r in reports]
    monitored = stop.monitor.split("/")[0] if stop is not None else None
    for ax, method in zip(axes[0], methods):
        ax.plot(steps, [r.value(f"{method}/live") for r in reports], marker="o", label="ours")
        if baseline is not None:
            base = baseline.value(f"{method}/live")
            ax.axhline(base, color="k", linestyle="--", label=f"baseline {base:.2f}")
            if method == monitored and stop.monitor.endswith("/live"):
                ax.axhline(stop.threshold(base), color="tab:red", linestyle=":",
                           label=f"stop threshold ({stop.describe_threshold(base).split(' = ')[0]})")
        if stop is not None and stop.stopped_step:
            ax.axvline(stop.stopped_step, color="tab:red", alpha=0.6, label=f"stopped at step {stop.stopped_step}")
        ax.set_title(f"{method} live tau")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel("tokens per target forward (tau)")
    heading = title
    if stop is not None and stop.stop_reason:
        heading += "\n" + stop.stop_reason.split(": ", 1)[-1]
    fig.suptitle(heading, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo(cfg: DemoConfig) -> dict:
    with torch_threads(1):  # toy models: one intra-op thread for training, one core left for scoring
        return _run_demo(cfg)


def _run_demo(cfg: DemoConfig) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    os.environ.setdefault("WANDB_SILENT", "true")  # the tables printed here say it all
    if cfg.wandb not in WANDB_MODES:
        raise ValueError(f"wandb must be one of {list(WANDB_MODES)}; got {cfg.wandb!r}")
    started = time.time()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    evaluation = dataclasses.replace(cfg.eval)
    evaluation.cache, evaluation.target, evaluation.baseline = resolve_world(cfg)
    evaluation.dirpath = evaluation.dirpath or str(out / "dflash")
    evaluation.baseline_cache_dir = evaluation.baseline_cache_dir or str(out / "baseline-reports")
    eval_cb, stop_cb = build_eval_callback(evaluation), build_stop_callback(cfg.stop)

    def show(report: EvalReport, baseline: EvalReport | None) -> None:
        print("\n" + comparison_table(report, baseline) + "\n", flush=True)

    eval_cb.subscribe(show)
    loggers = [CSVLogger(out, name="csv")]
    if cfg.wandb != "disabled":
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(project=cfg.wandb_project, save_dir=str(out), offline=cfg.wandb == "offline"))
    data = training_data(out / "world", cfg.train)
    trainer = pl.Trainer(
        max_steps=cfg.train.max_steps, max_epochs=-(-cfg.train.max_steps // len(data)),  # "Epoch 4/9", not "4/-2"
        accelerator="cpu", logger=loggers,
        callbacks=[eval_cb] + ([stop_cb] if stop_cb else []), enable_checkpointing=False,
        enable_model_summary=False, log_every_n_steps=10, default_root_dir=str(out),
    )
    trainer.fit(toy_module(cfg.train), data)
    if cfg.wandb != "disabled":
        import wandb

        wandb.finish()
    summary = {
        "steps": trainer.global_step, "max_steps": cfg.train.max_steps, "run": eval_cb.run_id,
        "reports": [r.step for r in eval_cb.reports], "stop_reason": getattr(stop_cb, "stop_reason", None),
        "seconds": time.time() - started, "results": str(eval_cb.run.results_path), "errors": eval_cb.errors,
    }
    if eval_cb.reports:
        title = f"demo run {eval_cb.run_id}: live tau of ours against the baseline ({len(eval_cb.reports)} reports)"
        summary["plot"] = str(plot_live_tau(eval_cb.reports, eval_cb.baseline_report, out / "live_tau.png",
                                            title=title, stop=stop_cb))
    print(f"\ntrained {summary['steps']} of {cfg.train.max_steps} steps in {summary['seconds']:.0f} s; "
          f"{len(eval_cb.reports)} reports in {summary['results']}")
    if summary["stop_reason"]:
        print(summary["stop_reason"])
    if "plot" in summary:
        print(f"live tau curves: {summary['plot']}")
    return summary


def add_demo_arguments(p) -> None:
    import argparse

    keys = "\n".join(f"  {key} = {value!r}" for key, value in config_keys(demo_config()))
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (f"settings (conf/demo.yaml over the callbacks' defaults; override any as key=value):\n{keys}\n\n"
                "writes under OUT (default runs/demo): world/ (toy caches), baseline-reports/, dflash/<run id>/ "
                "(results.jsonl, snapshots/), csv/version_N/metrics.csv, wandb/, live_tau.png")
    p.add_argument("overrides", nargs="*", help="key=value settings of DemoConfig, e.g. train.max_steps=300")


def run_demo_cli(args) -> int:
    run_demo(demo_config(args.overrides))
    return 0
