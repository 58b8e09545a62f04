"""Train the toy baseline drafter shipped in `dflash_callbacks/demos/toy/assets/baseline/`.

    python tools/train_toy_baseline.py --out dflash_callbacks/demos/toy/assets/baseline

The stronger recipe of the demo (`baseline_recipe`: two layers, a higher learning rate,
more steps) on the toy training text, saved in the published drafter layout.
Deterministic for a given seed and thread count (one intra-op thread).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from dflash_callbacks.demos.demo import TrainConfig, toy_module, training_data
from dflash_callbacks.demos.toy.threads import torch_threads
from dflash_callbacks.model import save_drafter


def baseline_recipe() -> TrainConfig:
    return TrainConfig(max_steps=2000, lr=2e-3, layers=2, sequences=512)


def build_toy_baseline(out: Path, world: Path, train: TrainConfig) -> Path:
    with torch_threads(1):
        module = toy_module(train)
        trainer = pl.Trainer(max_steps=train.max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_model_summary=False, enable_progress_bar=True)
        trainer.fit(module, training_data(world, train))
    return save_drafter(out, module.drafter.config, module.drafter.state_dict())


def main(argv: list[str] | None = None) -> None:
    recipe = baseline_recipe()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--world", type=Path, default=Path("runs/toy-baseline-world"), help="where the training text is cached")
    p.add_argument("--steps", type=int, default=recipe.max_steps)
    p.add_argument("--seed", type=int, default=recipe.seed)
    args = p.parse_args(argv)
    recipe.max_steps, recipe.seed = args.steps, args.seed
    started = time.time()
    folder = build_toy_baseline(args.out, args.world, recipe)
    log = {"recipe": recipe.__dict__, "seconds": round(time.time() - started, 1), "torch": torch.__version__,
           "torch_threads": 1}
    (folder / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"toy baseline written to {folder} in {log['seconds']} s")


if __name__ == "__main__":
    main()
