"""Attach the dflash evaluation to a transformers Trainer run of a DFlash drafter.

    python examples/hf_trainer.py        (about a minute on 2 CPU cores, the toy world built once)

The model below is "yours": an nn.Module that keeps its drafter at `.drafter` and returns the training
loss (the Trainer passes each batch to it as keyword arguments and reads `loss`). Here it trains a toy
drafter for the toy target with the published objective, and the toy folders stand in for your target,
your cache (`dflash-callbacks extract`) and your baseline drafter. The callback writes its run folder
under `<output_dir>/dflash/<run id>/`; running the script again starts a new run folder next to it, and
resuming from one of the Trainer's checkpoints (`trainer.train(resume_from_checkpoint=...)`) reopens
the same one.
"""

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from dflash_callbacks import DFlashDrafter, DrafterEvalTrainerCallback, TargetHead, TrailingBaselineStop
from dflash_callbacks.demos.toy import toy_world
from dflash_callbacks.demos.objective import CacheSequences, default_gamma, depth_weights, sequence_loss

torch.set_num_threads(1)  # the toy models are tiny: one thread trains, the other core scores
world = toy_world("runs/hf-example/world")  # target, cache, baseline and training data folders


# your existing run
class DrafterTraining(nn.Module):
    def __init__(self, config, target):
        super().__init__()
        self.drafter = DFlashDrafter(config)
        self.head = TargetHead.from_pretrained(target).requires_grad_(False)  # the target's embed_tokens and lm_head
        self.register_buffer("weights", depth_weights(config.block_size, default_gamma(config.block_size)),
                             persistent=False)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, sequences):
        losses = [sequence_loss(self.drafter, self.head, s["input_ids"], s["hidden"], s["prompt_len"], 4,
                                self.weights, self.generator) for s in sequences]
        return {"loss": torch.stack(losses).mean()}


args = TrainingArguments(output_dir="runs/hf-example", max_steps=60, per_device_train_batch_size=4,
                         learning_rate=3e-4, use_cpu=True, save_strategy="no", report_to="none",
                         remove_unused_columns=False, logging_steps=20, disable_tqdm=True)

# the lines you add
eval_cb = DrafterEvalTrainerCallback(
    cache=world.cache,          # from `dflash-callbacks extract`
    target=world.target,        # only embed_tokens and lm_head are read
    baseline=world.baseline,    # scored once, cached
    every_n_steps=20,
    drafter="drafter",          # or: lambda model: model.drafter
    scoring={"ddtree_budgets": [4, 8], "device": "cpu"},
    stop=TrailingBaselineStop(monitor="ddtree@8/live", min_ratio=0.9, patience=3, grace_steps=40),
)
trainer = Trainer(model=DrafterTraining(world.drafter_config, world.target), args=args,
                  train_dataset=CacheSequences(world.training_data), data_collator=lambda items: {"sequences": items},
                  callbacks=[eval_cb])
trainer.train()

print(f"{len(eval_cb.reports)} reports in {eval_cb.run.results_path}")
print(eval_cb.stop_reason or "not stopped")
