"""The lines a user adds to an existing Lightning training script of a DFlash drafter.

Your LightningModule keeps its drafter at `self.drafter` (a DFlashDrafter, or any
module whose state_dict has the published keys and whose `.config` describes it).
Run this file as it is to see it work on the toy world:

    python examples/attach_to_existing_run.py
"""

from pathlib import Path

import lightning.pytorch as pl
import torch

from dflash_callbacks import DrafterEvalCallback, TrailingBaselineStop
from dflash_callbacks.demos.demo import DemoConfig, resolve_world, toy_module, training_data

# --- your existing script: a module and its data (here: the toy world) -------------------------
torch.set_num_threads(1)  # the toy models are tiny: one thread trains, the other core scores
cfg = DemoConfig(out="runs/attach-example")
cache, target, baseline = resolve_world(cfg)  # your cache, target and baseline folders
module, data = toy_module(cfg.train), training_data(Path(cfg.out) / "world", cfg.train)
# ------------------------------------------------------------------------------------------------

# +++ the lines you add +++
eval_cb = DrafterEvalCallback(
    cache=cache,                 # from `dflash-callbacks extract`
    target=target,               # only embed_tokens and lm_head are read
    baseline=baseline,           # scored once, cached
    every_n_train_steps=100,
    drafter="drafter",           # or: lambda module: module.drafter
    scoring={"ddtree_budgets": [4, 8], "device": "cpu"},
)
stop_cb = TrailingBaselineStop(monitor="ddtree@8/live", min_ratio=0.9, patience=3, grace_steps=200)
trainer = pl.Trainer(max_steps=300, accelerator="cpu", callbacks=[eval_cb, stop_cb], logger=False,
                     enable_checkpointing=False)
# +++++++++++++++++++++++++

trainer.fit(module, data)
for report in eval_cb.reports:
    print(eval_cb.summary_line(report))
