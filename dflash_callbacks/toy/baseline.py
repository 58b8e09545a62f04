"""Train the toy baseline drafter shipped in `assets/baseline/`.

    python -m dflash_callbacks.toy.baseline --out dflash_callbacks/toy/assets/baseline

The stronger recipe of the demo (`demo.baseline_recipe`: two layers, a higher learning
rate, more steps) on the toy training text, saved in the published drafter layout.
Deterministic for a given seed and thread count.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    from ..demo import baseline_recipe, build_toy_baseline

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
           "torch_threads": 1}  # build_toy_baseline trains with one intra-op thread
    (folder / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"toy baseline written to {folder} in {log['seconds']} s")


if __name__ == "__main__":
    main()
