"""Attach the dflash callbacks to an existing Lightning training run of a DFlash drafter.

    python examples/attach_to_existing_run.py        (about a minute on 2 CPU cores)

The run below is "yours": a LightningModule that keeps its drafter at `.drafter` and a
DataLoader. Here they train a toy drafter for the toy target, whose folders stand in for
your target, your cache (`dflash-callbacks extract`) and your baseline drafter. The eval
callback writes its run folder under `<default_root_dir>/dflash/<run id>/`; running the
script again starts a new run folder next to it, and resuming from a checkpoint
(`trainer.fit(..., ckpt_path=...)`) reopens the same one.
"""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from dflash_callbacks import DrafterEvalCallback, TrailingBaselineStop
from dflash_callbacks.demos.toy import toy_world
from dflash_callbacks.demos.training import CacheSequences, DFlashTrainingModule, collate_sequences

torch.set_num_threads(1)  # the toy models are tiny: one thread trains, the other core scores
world = toy_world("runs/attach-example/world")  # target, cache, baseline and training data folders

# your existing run
module = DFlashTrainingModule(world.drafter_config, world.target, lr=3e-4)
data = DataLoader(CacheSequences(world.training_data), batch_size=4, shuffle=True, collate_fn=collate_sequences)

# the lines you add
eval_cb = DrafterEvalCallback(
    cache=world.cache,          # from `dflash-callbacks extract`
    target=world.target,        # only embed_tokens and lm_head are read
    baseline=world.baseline,    # scored once, cached
    every_n_train_steps=50,
    drafter="drafter",          # or: lambda module: module.drafter
    scoring={"ddtree_budgets": [4, 8], "device": "cpu"},
)
stop_cb = TrailingBaselineStop(monitor="ddtree@8/live", min_ratio=0.9, patience=3, grace_steps=100)
trainer = pl.Trainer(max_steps=150, accelerator="cpu", callbacks=[eval_cb, stop_cb], logger=False,
                     enable_checkpointing=False, default_root_dir="runs/attach-example")
trainer.fit(module, data)

print(f"{len(eval_cb.reports)} reports in {eval_cb.run.results_path}")
print(stop_cb.stop_reason or "not stopped: " + (stop_cb.last_decision.reason if stop_cb.last_decision else "no decision"))
