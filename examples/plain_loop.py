"""Attach the evaluator to a plain PyTorch training loop of a DFlash drafter (no Lightning).

    python examples/plain_loop.py        (about a minute on 2 CPU cores)

The loop below is "yours": a drafter, its optimizer, a DataLoader and the published training
objective (`dflash_callbacks.demos.objective.sequence_loss`). Here they train a toy drafter for the
toy target, whose folders stand in for your target, your cache (`dflash-callbacks extract`)
and your baseline drafter. The evaluator writes its run folder under `dirpath/<run id>/`;
under torchrun (DDP, FSDP2) every rank runs the same lines and rank 0 scores.
"""

import itertools

import torch
from torch.utils.data import DataLoader

from dflash_callbacks import DFlashDrafter, DrafterEvaluator, TargetHead, TrailingBaselineStop
from dflash_callbacks.demos.toy import toy_world
from dflash_callbacks.demos.objective import CacheSequences, collate_sequences, default_gamma, depth_weights, sequence_loss

torch.set_num_threads(1)  # the toy models are tiny: one thread trains, the other core scores
world = toy_world("runs/plain-loop-example/world")  # target, cache, baseline and training data folders

# your existing loop's pieces
torch.manual_seed(0)
drafter = DFlashDrafter(world.drafter_config)
head = TargetHead.from_pretrained(world.target).requires_grad_(False)  # the target's embedding and LM head
optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-4)
loader = DataLoader(CacheSequences(world.training_data), batch_size=4, shuffle=True, collate_fn=collate_sequences)
block = world.drafter_config.block_size
weights, generator = depth_weights(block, default_gamma(block)), torch.Generator().manual_seed(0)

# the lines you add
evaluator = DrafterEvaluator(cache=world.cache, target=world.target, baseline=world.baseline, every_n_steps=50,
                             stop=TrailingBaselineStop(monitor="ddtree@8/live", min_ratio=0.9, patience=3,
                                                       grace_steps=100),
                             dirpath="runs/plain-loop-example/eval", scoring={"ddtree_budgets": [4, 8], "device": "cpu"},
                             max_steps=150)
evaluator.attach(drafter, optimizer)   # every check before the first step; raises listing every problem
for step, batch in enumerate(itertools.islice(itertools.cycle(loader), 150), start=1):
    loss = torch.stack([sequence_loss(drafter, head, s["input_ids"], s["hidden"], s["prompt_len"], 16, weights,
                                      generator) for s in batch]).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if evaluator.step(step):              # True on every rank once the stop has decided
        break
evaluator.close()                          # the last step's report, then the run folder is released
print(f"{len(evaluator.history)} reports in {evaluator.run.path}; stop: {evaluator.stop_reason or 'none'}")
