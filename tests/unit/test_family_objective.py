"""The families' training objective (`dflash_callbacks.demos.family_objective`): for DFlash it is the published
objective, for DSpark DeepSpec's cross-entropy term, and 30 steps on the toy world's training data lower it
for a DSpark and a Domino drafter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.demos.toy import toy_drafter_config
from dflash_callbacks.demos.family_objective import block_loss, family_sequence_loss, slot_weights
from dflash_callbacks.model import TargetHead, build_drafter
from dflash_callbacks.model.families import domino, dspark
from dflash_callbacks.demos.objective import CacheSequences, depth_weights, sequence_loss

from family_cases import FAMILIES, case, head


def test_for_dflash_it_is_the_published_objective(toy_target, toy_training_cache_dir):
    torch.manual_seed(0)
    drafter = build_drafter(toy_drafter_config(block_size=8))
    target = TargetHead.from_pretrained(toy_target)
    sequence = CacheSequences(toy_training_cache_dir)[0]
    args = (drafter, target, sequence["input_ids"], sequence["hidden"], sequence["prompt_len"], 6)
    ours = family_sequence_loss(*args, slot_weights(7, 4.0), torch.Generator().manual_seed(3))
    published = sequence_loss(*args, depth_weights(8, 4.0), torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, published, atol=1e-6, rtol=0)


def test_for_dspark_it_is_deepspecs_cross_entropy_term():
    """DeepSpec's `ce_loss` (num / den) of its fixture run: every anchor 0 .. 18, slot k weighted exp(-k/4)."""
    inputs, expected = case("dspark")
    drafter = load_drafter(FAMILIES / "dspark" / "deepspec_checkpoint")
    with torch.no_grad():
        loss = block_loss(drafter, head(inputs), inputs["context_input_ids"], inputs["target_hidden"], torch.arange(19),
                          slot_weights(5, 4.0))
    ce = expected["deepspec_metric.ce_loss.num"] / expected["deepspec_metric.ce_loss.den"]
    torch.testing.assert_close(loss, ce[0], atol=2e-5, rtol=0)


FAMILY_SETTINGS = {
    "dspark": dspark.Settings(markov_rank=16, enable_confidence_head=True, confidence_head_with_markov=True),
    "domino": domino.Settings(emb_dim=32, gru_hidden_dim=32, pure_draft_prefix_len=1, shift_label=True),
}


@pytest.mark.parametrize("family", FAMILY_SETTINGS)
def test_thirty_steps_on_the_toy_world_lower_the_loss(family, toy_target, toy_training_cache_dir):
    """A fresh drafter of the family, the toy target's head frozen, AdamW, one sequence per step: the loss
    on four held-out sequences (fixed anchors) drops."""
    torch.manual_seed(0)
    config = dataclasses.replace(toy_drafter_config(block_size=8), family=family, family_config=FAMILY_SETTINGS[family])
    drafter = build_drafter(config).train()
    target = TargetHead.from_pretrained(toy_target).requires_grad_(False)
    data = CacheSequences(toy_training_cache_dir)
    weights = slot_weights(len(drafter.draft_rows(8)), 4.0)
    generator = torch.Generator().manual_seed(0)

    def held_out() -> float:
        with torch.no_grad():
            return sum(float(block_loss(drafter, target, s["input_ids"], s["hidden"],
                                        torch.arange(s["prompt_len"], s["input_ids"].numel() - 1, 7), weights))
                       for s in (data[i] for i in range(len(data) - 4, len(data)))) / 4

    before = held_out()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for step in range(30):
        s = data[step % (len(data) - 4)]
        loss = family_sequence_loss(drafter, target, s["input_ids"], s["hidden"], s["prompt_len"], 8, weights,
                                    generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert held_out() < 0.8 * before  # about 4.9 -> 3.0 (DSpark), 5.4 -> 3.0 (Domino)
