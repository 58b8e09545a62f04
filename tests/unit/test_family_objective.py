"""The one training objective of every family (`dflash_callbacks.demos.objective`): for DFlash it is the
published objective bit for bit (loss and gradients), for DSpark DeepSpec's cross-entropy term, and 30 steps
on the toy world's training data lower it for a DSpark and a Domino drafter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_callbacks import load_drafter
from dflash_callbacks.demos.toy import toy_drafter_config
from dflash_callbacks.model import TargetHead, build_drafter
from dflash_callbacks.model.families import domino, dspark
from dflash_callbacks.model.geometry import block_attention_mask, block_inputs, block_positions
from dflash_callbacks.demos.objective import (
    CacheSequences, block_loss, depth_weights, drafter_weights, sequence_loss, slot_weights,
)

from family_cases import FAMILIES, case, head


def published_loss(drafter, head, input_ids, hidden, prompt_len, blocks, weights, generator):
    """The published DFlash objective as written before families: the LM head on rows 1 .. B-1 of each block."""
    B, T = drafter.config.block_size, input_ids.numel()
    n = min(blocks, T - 1 - prompt_len)
    anchors = (prompt_len + torch.randperm(T - 1 - prompt_len, generator=generator)[:n]).sort().values
    tokens, labels, valid = block_inputs(input_ids, anchors, B, drafter.mask_token_id)
    C = int(anchors.max())
    out = drafter(hidden[:C][None], head.embed_tokens(tokens).flatten(0, 1)[None], block_positions(anchors, B, C)[None],
                  block_attention_mask(anchors, B, C))
    logits = head.lm_head(out.view(n, B, -1)[:, 1:]).float()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(n, B - 1)
    w = weights[None, :] * valid
    return (ce * w).sum() / w.sum()


def test_for_dflash_it_is_the_published_objective_bit_for_bit(toy_target, toy_training_cache_dir):
    """Loss and gradients equal the published objective's exactly, on sequences of the toy world."""
    torch.manual_seed(0)
    drafter = build_drafter(toy_drafter_config(block_size=8))
    target = TargetHead.from_pretrained(toy_target)
    assert torch.equal(drafter_weights(drafter), depth_weights(8, 4.0))
    assert torch.equal(slot_weights(7, 4.0), depth_weights(8, 4.0))
    data = CacheSequences(toy_training_cache_dir)
    for i in range(3):
        s = data[i]
        args = (drafter, target, s["input_ids"], s["hidden"], s["prompt_len"], 6, depth_weights(8, 4.0))
        grads = []
        for loss_fn in (sequence_loss, published_loss):
            loss = loss_fn(*args, torch.Generator().manual_seed(i))
            drafter.zero_grad()
            loss.backward()
            grads.append((loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
        (ours, ours_grads), (published, published_grads) = grads
        assert torch.equal(ours, published)
        assert all(torch.equal(a, b) for a, b in zip(ours_grads, published_grads))


def test_weights_of_another_length_than_the_drafters_slots_are_refused(toy_target, toy_training_cache_dir):
    config = dataclasses.replace(toy_drafter_config(block_size=8), family="dspark", family_config=dspark.Settings())
    drafter, target = build_drafter(config), TargetHead.from_pretrained(toy_target)
    s = CacheSequences(toy_training_cache_dir)[0]
    with pytest.raises(ValueError, match=r"weights has 7 entries, but a dspark drafter's block of 8 proposes 8 tokens: "
                                         r"pass slot_weights\(8, gamma\)"):
        sequence_loss(drafter, target, s["input_ids"], s["hidden"], s["prompt_len"], 4, depth_weights(8, 4.0),
                      torch.Generator().manual_seed(0))


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
    weights = drafter_weights(drafter, 4.0)
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
        loss = sequence_loss(drafter, target, s["input_ids"], s["hidden"], s["prompt_len"], 8, weights, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert held_out() < 0.8 * before  # about 4.9 -> 3.0 (DSpark), 5.4 -> 3.0 (Domino)
