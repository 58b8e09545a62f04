"""A toy DFlash 2 drafter: the toy baseline's backbone, convolutions at the identity, a fresh selector, trained a
few dozen steps on the toy target's own answers (the selector's loss with the backbone's). What the served-tau
checks decode live and score offline (`tests/support/served_live.py`, `benchmarks/bench_served_tau.py`); not a drafter to ship.
"""

from __future__ import annotations

import itertools
import json
import os

import torch

from ...model import DFlashDrafter, DrafterConfig, TargetHead, build_drafter, load_drafter
from ..objective import CacheSequences, default_gamma, depth_weights, sequence_loss
from .threads import torch_threads
from .world import toy_baseline_path, toy_target_path

SELECTOR = {"conv_group_size": 32, "conv_kernel_size": 2, "selector_rank": 16, "selector_top_k": 8}
"""The toy DFlash 2's own fields: 4 channel groups of the 128-wide backbone, 8 candidates per slot."""


def toy_dflash2_config() -> DrafterConfig:
    """The toy baseline's config as a DFlash 2 drafter (z-lab's layout, `SELECTOR`)."""
    raw = json.loads((toy_baseline_path() / "config.json").read_text())
    raw["architectures"] = ["DFlash2DraftModel"]
    raw["dflash_config"] = {**raw["dflash_config"], **SELECTOR}
    return DrafterConfig.from_dict(raw)


def toy_dflash2_drafter(training: str | os.PathLike, steps: int = 40, seed: int = 0, lr: float = 1e-3,
                        sequences_per_step: int = 4, blocks_per_sequence: int = 8) -> DFlashDrafter:
    """A toy DFlash 2 drafter trained `steps` AdamW steps on the cache-format folder `training` (the target's
    answers, e.g. `build_toy_training_cache`), from the toy baseline's backbone; everything it draws (the
    selector's init, the sequences, the anchors) comes from generators seeded with `seed`, never the global one."""
    with torch.random.fork_rng(devices=[]):  # the module's init draws from the global generator: a private copy
        torch.manual_seed(seed)
        drafter = build_drafter(toy_dflash2_config())
    missing, unexpected = drafter.load_state_dict(load_drafter(toy_baseline_path()).state_dict(), strict=False)
    if unexpected or not all(".attention_conv." in k or ".mlp_conv." in k or k.startswith("candidate_selector.")
                             for k in missing):
        raise ValueError(f"the toy baseline does not fit the toy DFlash 2 backbone: missing {missing}, "
                         f"unexpected {unexpected}")
    head = TargetHead.from_pretrained(toy_target_path()).requires_grad_(False)
    data, generator = CacheSequences(training), torch.Generator().manual_seed(seed)
    block = drafter.block_size
    weights = depth_weights(block, default_gamma(block))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    order = itertools.cycle(torch.randperm(len(data), generator=generator).tolist())
    drafter.train()
    with torch_threads(1):
        for _ in range(steps):
            batch = [data[next(order)] for _ in range(sequences_per_step)]
            loss = torch.stack([sequence_loss(drafter, head, s["input_ids"], s["hidden"], s["prompt_len"],
                                              blocks_per_sequence, weights, generator) for s in batch]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return drafter.eval().requires_grad_(False)
