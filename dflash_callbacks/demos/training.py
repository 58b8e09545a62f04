"""The drafters' training objective (`demos.objective`) as a LightningModule, for a drafter of any
family (`build_drafter`: the config's family builds its drafter, the objective weighs its own draft
slots): what the demo trains. `CacheSequences` and `collate_sequences` are re-exported from there."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch

from ..model import DrafterConfig, TargetHead, build_drafter
from .objective import CacheSequences, collate_sequences, default_gamma, drafter_weights, sequence_loss

__all__ = ["CacheSequences", "DFlashTrainingModule", "collate_sequences"]


class DFlashTrainingModule(pl.LightningModule):
    def __init__(
        self,
        drafter_config: DrafterConfig | dict,
        target: str | os.PathLike,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 20,
        blocks_per_sequence: int = 16,
        gamma: float | None = None,
        seed: int = 0,
    ):
        super().__init__()
        config = drafter_config if isinstance(drafter_config, DrafterConfig) else DrafterConfig.from_dict(drafter_config)
        self.save_hyperparameters({"drafter_config": config.to_dict(), "target": str(target), "lr": lr,
                                   "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                                   "blocks_per_sequence": blocks_per_sequence, "gamma": gamma, "seed": seed})
        self.drafter = build_drafter(config)  # the drafter of its family
        # the target's embedding and LM head, frozen (train mode only spares Lightning's
        # eval-mode warning: neither has dropout)
        self.head = TargetHead.from_pretrained(target).requires_grad_(False).train()
        self.gamma = gamma or default_gamma(config.block_size)
        self.register_buffer("weights", drafter_weights(self.drafter, self.gamma), persistent=False)  # its own slots
        self.generator = torch.Generator().manual_seed(seed)

    def sequence_loss(self, input_ids: torch.Tensor, hidden: torch.Tensor, prompt_len: int) -> torch.Tensor:
        return sequence_loss(self.drafter, self.head, input_ids, hidden, prompt_len, self.hparams.blocks_per_sequence,
                             self.weights, self.generator)

    def training_step(self, batch: list[dict], batch_idx: int) -> torch.Tensor:
        losses = [self.sequence_loss(s["input_ids"], s["hidden"], s["prompt_len"]) for s in batch]
        loss = torch.stack(losses).mean()
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.drafter.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup = max(1, self.hparams.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def state_dict(self, *args, **kwargs):
        """The target's head is not part of the checkpoint: it is read from `target`."""
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        return {k: v for k, v in state.items() if not k.startswith(prefix + "head.")}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        head = {f"head.{k}": v for k, v in self.head.state_dict().items()}
        return super().load_state_dict({**state_dict, **head}, strict=strict, assign=assign)
