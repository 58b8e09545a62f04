"""The same small training run in every kind of loop the evaluator attaches to, for the tests
that hold each entry point to the same guarantees.

- `plain_fit`: a plain PyTorch loop with `DrafterEvaluator` (what SpecForge- or speculators-style
  trainers look like), checkpointing the model, the optimizer and `evaluator.state_dict()` in its
  own file every `ckpt_every` steps, and resuming from one;
- `hf_fit`: the transformers `Trainer` with `DrafterEvalTrainerCallback` (checkpoints are the
  Trainer's own `checkpoint-N/` folders; a resume goes through `resume_from_checkpoint`);
- `two_ranks`: a training script of tests/scripts/ under torchrun, two gloo processes.

Both train the synthetic world's drafter (tests/support/synthetic.py) with the published objective
(`dflash_callbacks.demos.objective.sequence_loss`) on the world's cache, one sequence per step, in a
fixed order, so two runs with the same seed compute the same weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from dflash_callbacks import DrafterConfig, DrafterEvaluator, TargetHead, build_drafter
from dflash_callbacks.demos.objective import CacheSequences, drafter_weights, sequence_loss

LR = 3e-3
SCORING = {"ddtree_budgets": [4], "device": "cpu"}


class DrafterModel(nn.Module):
    """A drafter (of any family) with its loss, as a trainer holds it: `drafter` and the frozen target `head`;
    forward returns the objective's loss of one sequence (the transformers Trainer
    passes the batch as keyword arguments and reads `loss`)."""

    def __init__(self, config: DrafterConfig, target: Path, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.drafter = build_drafter(config)  # the drafter of the config's family
        self.head = TargetHead.from_pretrained(target).requires_grad_(False)
        self.register_buffer("weights", drafter_weights(self.drafter), persistent=False)
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, prompt_len: torch.Tensor) -> dict:
        loss = sequence_loss(self.drafter, self.head, input_ids.flatten(), hidden.flatten(0, -2), int(prompt_len),
                             4, self.weights, self.generator)
        return {"loss": loss}


class Sequences(Dataset):
    """The world's cache as training examples, `length` of them, cycling in a fixed order."""

    def __init__(self, cache: Path, length: int):
        self.sequences, self.length = CacheSequences(cache), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        s = self.sequences[i % len(self.sequences)]
        return {"input_ids": s["input_ids"], "hidden": s["hidden"], "prompt_len": torch.tensor(s["prompt_len"])}


def one(items: list[dict]) -> dict:
    """Batches of one sequence (sequences differ in length)."""
    (item,) = items
    return item


def plain_fit(world, max_steps: int, evaluator: DrafterEvaluator | None = None, *, ckpt_dir: Path | None = None,
              ckpt_every: int = 0, resume: Path | None = None, before_eval: Callable | None = None,
              after_step: Callable | None = None) -> DrafterModel:
    """Train for `max_steps` steps (from a resume's step, with `resume`), with `evaluator` attached
    (None: no evaluation). `before_eval(model, step)` runs after each optimizer step, before the evaluator's
    step (which takes the snapshot), `after_step(model, step)` after it; a True from the evaluator ends
    training."""
    model = DrafterModel(world.config, world.target)
    optimizer = torch.optim.AdamW(model.drafter.parameters(), lr=LR)
    data = Sequences(world.cache, 10**6)
    start = 0
    if resume is not None:
        saved = torch.load(resume, weights_only=False)
        model.drafter.load_state_dict(saved["drafter"])
        optimizer.load_state_dict(saved["optimizer"])
        model.generator.set_state(saved["generator"])
        start = saved["step"]
    if evaluator is not None:
        evaluator.attach(model.drafter, optimizer)
        if resume is not None:
            evaluator.load_state_dict(saved["evaluator"])
    with evaluator if evaluator is not None else _nothing():
        for step in range(start + 1, max_steps + 1):
            loss = model(**one([data[step - 1]]))["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if before_eval is not None:
                before_eval(model, step)
            stop = evaluator.step(step) if evaluator is not None else False
            if after_step is not None:
                after_step(model, step)
            if ckpt_dir is not None and ckpt_every and step % ckpt_every == 0:
                ckpt_dir.mkdir(parents=True, exist_ok=True)
                torch.save({"drafter": model.drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                            "generator": model.generator.get_state(),
                            "evaluator": evaluator.state_dict() if evaluator is not None else None},
                           ckpt_dir / f"step={step}.pt")
            if stop:
                break
        if evaluator is not None:
            evaluator.close()
    return model


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def hf_fit(world, out: Path, max_steps: int, callbacks: list, *, save_steps: int = 0, resume: str | None = None,
           report_to: str = "none", seed: int = 0, **training_args):
    """A transformers Trainer run of `max_steps` steps in `out`; returns (trainer, model). `training_args`
    override the TrainingArguments; with an `eval_strategy`, the evaluation set is the cache's first 3
    sequences."""
    from transformers import Trainer, TrainingArguments

    model = DrafterModel(world.config, world.target, seed=seed)
    args = TrainingArguments(**{
        "output_dir": str(out), "max_steps": max_steps, "per_device_train_batch_size": 1,
        "per_device_eval_batch_size": 1, "learning_rate": LR, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "weight_decay": 0.0, "logging_steps": 1000,
        "report_to": report_to, "save_strategy": "steps" if save_steps else "no", "save_steps": save_steps or 500,
        "use_cpu": True, "seed": seed, "data_seed": seed, "remove_unused_columns": False, "disable_tqdm": True,
        "dataloader_num_workers": 0, "optim": "adamw_torch", **training_args,
    })
    evaluate = training_args.get("eval_strategy", "no") != "no"
    trainer = Trainer(model=model, args=args, train_dataset=Sequences(world.cache, max_steps * 4),
                      eval_dataset=Sequences(world.cache, 3) if evaluate else None, data_collator=one,
                      callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


def two_ranks(script: Path, args: list[str], root: Path, port: int, timeout: float = 300) -> tuple[dict, dict]:
    """`script` (run with `--root root --record` besides `args`) under torchrun with 2 gloo processes;
    returns the records rank 0 and rank 1 wrote (root/rank{N}.json). On a timeout, torchrun and every
    rank (each names `root` on its command line) are killed and the test fails with the log's tail."""
    import pytest

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           str(script), "--root", str(root), "--record", *args]
    log = root.parent / f"{root.name}-torchrun.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            subprocess.run(["pkill", "-9", "-f", str(root)])
            pytest.fail(f"torchrun hung for {timeout:g} s:\n{log.read_text()[-6000:]}")
    assert proc.returncode == 0, log.read_text()[-8000:]
    return tuple(json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1))
