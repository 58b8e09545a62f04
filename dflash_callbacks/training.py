"""Training a DFlash drafter with the published objective, as a LightningModule.

Per sequence (target tokens and hidden states from a cache-format folder), draw
`blocks_per_sequence` random anchors inside the completion. Each block is the anchor
token followed by B-1 mask tokens; it sees the target context before its anchor and
itself, never another block (the scorer's block mask). The loss is the cross-entropy
at block positions d = 1..B-1 against the target's tokens tok[a+d], weighted by
exp(-(d-1)/gamma) (gamma 7 for B = 16, 4 for B = 8), averaged over valid labels.

This module is what the demo trains, and the reference a user can hold their own
training step against.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .cache.format import HiddenStateCache
from .model import DFlashDrafter, DrafterConfig, TargetHead
from .model.geometry import block_attention_mask, block_inputs, block_positions


def default_gamma(block_size: int) -> float:
    """7 for B = 16 and 4 for B = 8 (the published settings), linear in between."""
    return {16: 7.0, 8: 4.0}.get(block_size, max(1.0, 0.4375 * block_size))


def depth_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(d-1)/gamma) for d = 1..B-1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


class CacheSequences(Dataset):
    """Every task of a cache-format folder as {"input_ids", "hidden", "prompt_len"}."""

    def __init__(self, path: str | os.PathLike):
        self.cache = HiddenStateCache(path)
        self.names = [n for n in self.cache.task_names if self.cache.entry(n)["num_tokens"] - self.cache.entry(n)["prompt_len"] >= 2]
        if not self.names:
            raise ValueError(f"no sequence in {path} has a completion of at least 2 tokens")

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> dict:
        task = self.cache.task(self.names[i])
        return {"input_ids": task.input_ids, "hidden": task.hidden, "prompt_len": task.prompt_len}


def collate_sequences(items: list[dict]) -> list[dict]:
    return items  # sequences differ in length; the step loops over them


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
        self.drafter = DFlashDrafter(config)
        # the target's embedding and LM head, frozen (train mode only spares Lightning's
        # eval-mode warning: neither has dropout)
        self.head = TargetHead.from_pretrained(target).requires_grad_(False).train()
        self.gamma = gamma or default_gamma(config.block_size)
        self.register_buffer("weights", depth_weights(config.block_size, self.gamma), persistent=False)
        self.generator = torch.Generator().manual_seed(seed)

    def sequence_loss(self, input_ids: torch.Tensor, hidden: torch.Tensor, prompt_len: int) -> torch.Tensor:
        B, T = self.drafter.config.block_size, input_ids.numel()
        n_anchors = min(self.hparams.blocks_per_sequence, T - 1 - prompt_len)
        anchors = prompt_len + torch.randperm(T - 1 - prompt_len, generator=self.generator)[:n_anchors]
        anchors = anchors.sort().values.to(input_ids.device)
        tokens, labels, valid = block_inputs(input_ids, anchors, B, self.drafter.mask_token_id)
        C = int(anchors.max())
        positions = block_positions(anchors, B, C)
        out = self.drafter(
            hidden[:C][None].to(self.drafter.fc.weight.dtype),
            self.head.embed_tokens(tokens).flatten(0, 1)[None],
            positions[None],
            block_attention_mask(anchors, B, C),
        )
        logits = self.head.lm_head(out.view(n_anchors, B, -1)[:, 1:]).float()
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(n_anchors, B - 1)
        w = self.weights[None, :] * valid
        return (ce * w).sum() / w.sum()

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
